"""What an environment variable may be: which names hold secrets, and the sizes Linux lets a
process start with (the hosts file, ``--env`` and the plan all check the same limits)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

# Variable names whose values are secret: masked wherever clusterrun shows or stores a value
# (``environment.mask_env``), and refused in the hosts file's ``env:`` (whose text the job's record keeps).
SECRET_PATTERNS = ("*_TOKEN", "*_KEY", "*SECRET*", "*PASSWORD*", "*PASSPHRASE*")


def looks_secret(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether variable ``name`` holds a secret: it matches ``SECRET_PATTERNS`` (ignoring case) or
    one of ``extra`` (``secret_env:`` names or glob patterns, matched exactly)."""
    upper = name.upper()
    return (any(fnmatch.fnmatchcase(upper, p) for p in SECRET_PATTERNS)
            or any(fnmatch.fnmatchcase(name, p) for p in extra))


# One NAME=VALUE of the environment, in bytes: Linux refuses a longer string to exec (MAX_ARG_STRLEN,
# 128 KiB with its NUL), so torchrun would never start on the hosts.
MAX_ENV_ENTRY = 128 * 1024 - 1
MAX_ENV_TOTAL = 1024 * 1024  # all of a node's variables from the hosts file or --env: half of ARG_MAX


def check_env_entry(name: str, value: str) -> str | None:
    """Why ``NAME=VALUE`` cannot reach a process's environment, or None."""
    size = len(name.encode()) + 1 + len(value.encode("utf-8", "surrogateescape"))
    if size > MAX_ENV_ENTRY:
        return (f"the value is too long ({size:,} bytes with its name; at most {MAX_ENV_ENTRY:,}: "
                "Linux refuses a longer environment string to a new process)")
    return None


def check_env_total(env: Mapping[str, str]) -> str | None:
    """Why ``env`` is too large for a process's environment, or None."""
    size = sum(len(k.encode()) + len(v.encode("utf-8", "surrogateescape")) + 2 for k, v in env.items())
    if size > MAX_ENV_TOTAL:
        return f"the environment is too large ({size:,} bytes; at most {MAX_ENV_TOTAL:,})"
    return None
