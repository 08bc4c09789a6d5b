"""A node's environment from this machine: ``env_file`` and ``forward_env`` read, secrets masked.

Precedence, weakest first (``plan.node_env`` adds the outer levels):

    clusterrun's defaults (OMP_NUM_THREADS=1, PYTHONUNBUFFERED=1)
    < forward_env  (this machine's variables matching the patterns)
    < env_file     (the files in order: top level, defaults, the host's own; later files win)
    < env          (top level < defaults < the host's own)
    < --env        (the command line)
    < CUDA_VISIBLE_DEVICES from ``gpus``

Both are read by the controller that starts an attempt (``up``, ``restart``, a monitor's
start-up retry), every time: a secret's value is never kept on this machine. Values of variables
that look secret (``envrules.looks_secret``: ``*_TOKEN``, ``*_KEY``, ``*SECRET*``,
``*PASSWORD*``, and ``secret_env:``) are shown and stored as ``MASK``; ``redact`` takes them out
of text that came from a host (an error message).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping

from clusterrun.config.envrules import check_env_entry, check_env_total, looks_secret
from clusterrun.config.hostsfile import ClusterSpec, EnvFile, HostSpec
from clusterrun.core.errors import ConfigError

MASK = "****"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MIN_REDACTED = 4  # shorter values would mask every digit of a message


def parse_dotenv(text: str, path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (``export `` allowed before KEY; blank lines and ``#`` comments skipped).
    A value is taken verbatim, no ``$VAR`` expansion: unquoted (trimmed, `` #...`` after a space
    is a comment), in single quotes (as is) or double quotes (``\\n``, ``\\t``, ``\\"``, ``\\\\``).
    Raises ``ConfigError`` naming the file and line; never quotes a value (it may be a secret)."""
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export ") or line.startswith("export\t"):
            line = line[len("export"):].lstrip()
        name, sep, value = line.partition("=")
        name = name.rstrip()
        if not sep:
            raise ConfigError("expected NAME=VALUE", path=path, line=number,
                              hint="one variable per line, e.g. HF_TOKEN=hf_..., or a # comment")
        if not _NAME.match(name):
            raise ConfigError(f"invalid environment variable name {name!r}", path=path, line=number,
                              hint="use letters, digits and '_', not starting with a digit")
        env[name] = _dotenv_value(value.strip(), path, number, name)
        if (problem := check_env_entry(name, env[name])) is not None:
            raise ConfigError(problem, path=path, line=number, key=name)
    return env


def _dotenv_value(value: str, path: str, number: int, name: str) -> str:
    if value[:1] in ("'", '"'):
        quote = value[0]
        end = value.find(quote, 1)
        if quote == '"':
            end = 1
            while end < len(value) and value[end] != '"':
                end += 2 if value[end] == "\\" else 1
            end = end if end < len(value) else -1
        if end < 0:
            raise ConfigError(f"the value has no closing {quote}", path=path, line=number, key=name,
                              hint="values in quotes must end on the same line")
        rest = value[end + 1:].strip()
        if rest and not rest.startswith("#"):
            raise ConfigError(f"unexpected text after the closing {quote}", path=path, line=number, key=name)
        inner = value[1:end]
        if quote == "'":
            return inner
        escapes = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$"}
        return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), "\\" + m.group(1)), inner)
    comment = re.search(r"\s#", value)
    return (value[:comment.start()] if comment else value).strip()


def read_env_file(ref: EnvFile, hosts_file: str) -> dict[str, str]:
    """The variables of ``ref``; a file that cannot be read is reported at its line of the hosts file."""
    try:
        with open(ref.path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {ref.path}: {exc.strerror or exc}", path=hosts_file, line=ref.line,
                          key=ref.key, hint="relative paths are taken from the hosts file's directory") from exc
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError("the file is not UTF-8 text", path=ref.path, line=line) from exc
    if "\x00" in text:
        raise ConfigError("the file holds a NUL character", path=ref.path)
    return parse_dotenv(text, ref.path)


def forwarded(patterns: Iterable[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` whose names match one of ``patterns`` (case matters)."""
    patterns = tuple(patterns)
    return {name: value for name, value in environ.items()
            if _NAME.match(name) and any(fnmatch.fnmatchcase(name, p) for p in patterns)}


def resolve(spec: ClusterSpec, environ: Mapping[str, str]) -> tuple[ClusterSpec, list[str]]:
    """``spec`` with each host's ``env`` completed by its ``forward_env`` (from ``environ``) and
    ``env_file`` (read now), and notes on what was asked for and not found (a forwarded name
    that is not set). Raises ``ConfigError`` for a file that cannot be read or parsed."""
    files: dict[str, dict[str, str]] = {}
    notes: list[str] = []
    hosts: list[HostSpec] = []
    matched: dict[tuple[str, ...], dict[str, str]] = {}  # hosts share their patterns: environ scanned once
    for host in spec.hosts:
        patterns = tuple(host.forward_env)
        if patterns not in matched:
            matched[patterns] = forwarded(patterns, environ)
        env = dict(matched[patterns])
        for name in host.forward_env:
            if not any(c in name for c in "*?") and name not in environ:
                note = f"forward_env: {name} is not set in this environment; it is not passed on"
                if note not in notes:
                    notes.append(note)
        for ref in host.env_file:
            if ref.path not in files:
                files[ref.path] = read_env_file(ref, spec.path)
            env.update(files[ref.path])
        env.update(host.env)
        if (problem := check_env_total(env)) is not None:
            raise ConfigError(f"{problem}: forward_env, env_file and env together for host {host.host!r}",
                              path=spec.path, line=host.line, hint="pass large data in a file on the hosts")
        hosts.append(dataclasses.replace(host, env=env))
    return dataclasses.replace(spec, hosts=tuple(hosts)), notes


def mask_env(env: Mapping[str, str], secret_env: Iterable[str] = ()) -> dict[str, str]:
    """``env`` with the values of secret-looking names replaced by ``MASK``."""
    extra = tuple(secret_env)
    return {name: MASK if looks_secret(name, extra) else value for name, value in env.items()}


def secret_names(env: Mapping[str, str], secret_env: Iterable[str] = ()) -> list[str]:
    extra = tuple(secret_env)
    return sorted(name for name in env if looks_secret(name, extra))


def unmask(env: Mapping[str, str], environ: Mapping[str, str], what: str) -> dict[str, str]:
    """``env`` read back from a record, its masked values taken from ``environ`` again (for a
    later attempt); ``ConfigError`` for one that is not set there."""
    result = dict(env)
    for name, value in env.items():
        if value == MASK:
            if name not in environ:
                raise ConfigError(f"{name}: its value is secret, so it was not kept on this machine, and {name} is "
                                  "not set in this environment", key=what,
                                  hint=f"export {name}=... and run this again (or use forward_env / env_file)")
            result[name] = environ[name]
    return result


def redact(text: str, env: Mapping[str, str], secret_env: Iterable[str] = ()) -> str:
    """``text`` with every secret value of ``env`` (of 4 characters or more) replaced by ``MASK``."""
    values = sorted({v for k, v in env.items() if len(v) >= _MIN_REDACTED and looks_secret(k, tuple(secret_env))},
                    key=len, reverse=True)
    for value in values:
        text = text.replace(value, MASK)
    return text
