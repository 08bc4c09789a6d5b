"""The host's cache of agent versions (see the package docstring): each version's bytecode
compiled once per interpreter, and versions unused for long removed."""

from __future__ import annotations

import os
import sys
import time

PRUNE_AFTER = 7 * 24 * 3600.0  # seconds since its last use after which a version is removed


def compile_zip(folder: str, digest: str, source: str) -> str:
    """Write ``agent-<digest>-<cache tag>-<crc32>.zip``: the sources of the zip at ``source``
    with their bytecode beside them (stored: read without inflating; unchecked hash-based .pyc: this
    zip only ever holds the sources they were compiled from); its path. Run once per version and interpreter."""
    import importlib.util
    import io
    import marshal
    import zipfile
    import zlib

    out = io.BytesIO()
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for name in sorted(src.namelist()):
            data = src.read(name)
            dst.writestr(zipfile.ZipInfo(name), data, zipfile.ZIP_DEFLATED)  # read only for a traceback
            if name.endswith(".py"):
                code = compile(data, f"{source}/{name}", "exec", dont_inherit=True)
                header = importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little") + importlib.util.source_hash(data)
                dst.writestr(zipfile.ZipInfo(name + "c"), header + marshal.dumps(code))
    data = out.getvalue()
    path = os.path.join(folder, f"agent-{digest}-{sys.implementation.cache_tag}-{zlib.crc32(data):08x}.zip")
    tmp = f"{path}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.rename(tmp, path)
    return path


def prune(folder: str, digest: str, now: float | None = None) -> list[str]:
    """Remove the versions (and temporary files) not used for ``PRUNE_AFTER`` seconds, except
    ``digest``'s; the names removed."""
    now = time.time() if now is None else now
    removed = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.startswith("agent-") or name.startswith(f"agent-{digest}"):
            continue
        try:
            if now - os.stat(path).st_mtime > PRUNE_AFTER:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass  # removed by another agent at the same moment
    return removed
