"""``clusterrun web``: every job of this controller in a browser, live, from a laptop or a phone.

A consumer, like ``tui/``: it reads jobs as ``ps`` and ``logs`` do (``views.joblist``'s documents,
``life.lookup``, the agents' ``follow``) and stops them as ``down`` does (``life.down``). One process
serves every viewer: ``app`` (the routes, Starlette on uvicorn), ``feeds`` (one reader per job attempt
fanned out to its viewers), ``watch`` (which jobs' records changed: one look at the store for every
page), ``guard`` (token, cookie, same origin), ``jobs`` (the blocking reads), ``chart`` (the loss chart).
Only ``clusterrun web`` imports this package, so the controller without the ``web`` extra never
loads Starlette. docs/web.md says how to use it, and why these libraries.
"""
