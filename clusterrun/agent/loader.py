"""What ``BOOTSTRAP`` runs on a host (sent on every connection, so kept small): find the agent's
zip in the user's cache or have the controller send it, then serve from it (package docstring)."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from hashlib import sha256
else:
    try:  # needed only for a zip not compiled yet; hashlib would cost 3 ms (OpenSSL)
        from _sha256 import sha256
    except ImportError:
        try:
            from _sha2 import sha256  # Python >= 3.12
        except ImportError:
            from hashlib import sha256


def cache_dir() -> str:
    """The user's cache, or where none can be made (no home, a read-only one) a directory of this
    user's in the temporary directory (checked as strictly: /tmp is everybody's)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    try:
        os.makedirs(os.path.join(base, "clusterrun"), mode=0o700, exist_ok=True)
    except OSError:
        return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"clusterrun-{os.getuid()}")
    return os.path.join(base, "clusterrun")


def cache_problem(folder: str) -> str:
    """Make ``folder`` (0700) if needed; why it cannot hold code run as this user, or ""."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder)
    except OSError as exc:
        return f"cannot use the agent's cache {folder}: {exc.strerror or exc}. Fix: set XDG_CACHE_HOME to a " \
               "directory of your own"
    if st.st_uid != os.getuid():
        return f"the agent's cache {folder} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): code " \
               "there would run as you. Fix: remove it, or set XDG_CACHE_HOME to a directory of your own"
    if st.st_mode & 0o022:
        return f"the agent's cache {folder} is writable by others (mode {st.st_mode & 0o777:o}): code there " \
               f"would run as you. Fix: chmod 700 {folder}"
    return ""


def intact(path: str, digest: str) -> bool:
    """Whether the file at ``path`` has the sha256 ``digest`` (a zip as the controller sent it)."""
    try:
        with open(path, "rb") as f:
            return sha256(f.read()).hexdigest() == digest
    except OSError:
        return False


def compiled(folder: str, digest: str) -> str | None:
    """The intact compiled zip of version ``digest`` for this interpreter, named by its CRC-32
    (made here, in a directory only this user may write: a check against damage, a fifth of a
    sha256's cost at every start); a damaged one is removed."""
    import zlib

    prefix = f"agent-{digest}-{sys.implementation.cache_tag}-"
    for name in os.listdir(folder):
        if name.startswith(prefix) and name.endswith(".zip"):
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    if f"{zlib.crc32(f.read()):08x}" == name[len(prefix):-4]:
                        return path
                os.unlink(path)
            except OSError:
                pass  # removed by another agent at the same moment
    return None


def main() -> int:
    stdin = sys.stdin.buffer
    fields = stdin.readline().decode("ascii").split()
    digest, size, push = fields[0], int(fields[1]), "push" in fields[2:]
    # "ahead": the first request came with the preamble (one round trip fewer), before any zip
    first = stdin.readline() if "ahead" in fields[2:] else b""
    folder = cache_dir()
    problem = cache_problem(folder)
    if problem or len(digest) != 64 or digest.strip("0123456789abcdef"):
        sys.stderr.write(f"clusterrun: {problem or 'not a sha256: ' + digest}\n")
        return 2
    source = os.path.join(folder, f"agent-{digest}.zip")
    run = compiled(folder, digest) or (source if intact(source, digest) else None)
    data = stdin.read(size) if push else b""
    if not push:
        sys.stdout.write('{"agent": "%s"}\n' % ("have" if run else "need"))
        sys.stdout.flush()
        if run is None:
            data = stdin.read(size)
    installed = run is None
    if run is None:
        if sha256(data).hexdigest() != digest:
            sys.stderr.write(f"clusterrun: the agent's zip arrived damaged ({len(data)} of {size} bytes)\n")
            return 2
        tmp = f"{source}.{os.urandom(6).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(tmp, source)  # never replaced in place: a reader sees the old file or the new one
        run = source
    else:
        os.utime(run)  # its last use: versions unused for long are pruned
    sys.path.insert(0, run)
    serve = __import__("clusterrun_agent.serve", fromlist=["main"])
    return int(serve.main(folder, digest, run, installed, first))


if __name__ == "__clusterrun_loader__":
    sys.exit(main())
