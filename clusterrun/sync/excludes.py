r""".gitignore-style exclude patterns for the sync (``clusterrun.sync.tree``): pure, no I/O.

Supported: ``#`` comments and blank lines; ``!`` to re-include (the last matching pattern decides);
a trailing ``/`` for directories only; a ``/`` at the start or in the middle anchors the pattern to
the directory of its file (else it matches a name at any depth); ``*``, ``?``, ``[...]`` (``[!...]``)
within one path component; ``**`` across components (``**/x``, ``x/**``, ``a/**/b``); ``\`` escapes
the next character. A file in an excluded directory cannot be re-included (the walk does not enter
it), as in git. Not supported: trailing spaces kept by ``\ ``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from clusterrun.core.frozen import frozen

DEFAULT_EXCLUDES = (".git",)


@frozen
class Rule:
    """One pattern: ``base`` is the directory (relative, "" for the top) whose paths it applies to."""

    base: str
    regex: re.Pattern[str]
    negated: bool
    dir_only: bool
    text: str


def _translate(pattern: str) -> str:
    """A gitignore glob (without ``!``, leading or trailing ``/``) as a regular expression."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**", i):
            j = i + 2
            if (i == 0 or pattern[i - 1] == "/") and (j == n or pattern[j] == "/"):
                if j == n:
                    out.append(".*")  # `dir/**`: everything inside
                else:
                    out.append("(?:[^/]*/)*")  # `**/`: any number of directories
                    j += 1
                i = j
                continue
            out.append("[^/]*")
            i = j
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 2 if pattern[i + 1:i + 2] in ("!", "^") else i + 1)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def parse_rule(line: str, base: str = "") -> Rule | None:
    """One line of a .gitignore (or one ``sync_exclude`` pattern); None for blanks and comments."""
    text = line.rstrip("\n").rstrip()
    if not text or text.startswith("#"):
        return None
    negated = text.startswith("!")
    if negated:
        text = text[1:]
    elif text.startswith(("\\!", "\\#")):
        text = text[1:]
    dir_only = text.endswith("/")
    pattern = text.rstrip("/")
    if not pattern:
        return None
    anchored = "/" in pattern
    pattern = pattern.lstrip("/")
    regex = _translate(pattern)
    if not anchored:
        regex = "(?:.*/)?" + regex
    return Rule(base, re.compile(regex, re.S), negated, dir_only, line.strip())


def parse_rules(text: str, base: str = "") -> list[Rule]:
    return [r for r in (parse_rule(line, base) for line in text.splitlines()) if r is not None]


@frozen
class Excludes:
    """The rules that apply in one directory: the defaults, the .gitignore files from the top down
    to it, then ``sync_exclude``; the last rule that matches a path decides."""

    head: tuple[Rule, ...] = ()
    gitignore: tuple[Rule, ...] = ()
    tail: tuple[Rule, ...] = ()

    @classmethod
    def of(cls, patterns: Sequence[str] = (), defaults: Sequence[str] = DEFAULT_EXCLUDES) -> Excludes:
        head = tuple(r for r in (parse_rule(p) for p in defaults) if r is not None)
        tail = tuple(r for r in (parse_rule(p) for p in patterns) if r is not None)
        return cls(head, (), tail)

    def below(self, base: str, gitignore_text: str) -> Excludes:
        """These rules plus those of the .gitignore of directory ``base``."""
        return Excludes(self.head, self.gitignore + tuple(parse_rules(gitignore_text, base)), self.tail)

    def excluded(self, path: str, is_dir: bool) -> bool:
        """Whether ``path`` (relative, ``/``-separated) is left out."""
        verdict = False
        for rule in (*self.head, *self.gitignore, *self.tail):
            if rule.dir_only and not is_dir:
                continue
            if rule.base:
                if not path.startswith(rule.base + "/"):
                    continue
                rel = path[len(rule.base) + 1:]
            else:
                rel = path
            if rule.regex.fullmatch(rel):
                verdict = not rule.negated
        return verdict


__all__ = ["DEFAULT_EXCLUDES", "Excludes", "Rule", "parse_rule", "parse_rules"]
