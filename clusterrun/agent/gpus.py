"""``gpus``: each GPU's utilisation and memory now, from ``nvidia-smi``, for the dashboard and ``ps``.

A host without nvidia-smi answers ``found: false``; one whose nvidia-smi fails, hangs or prints
something else answers ``problem`` (with ``ok: true``: one host's broken driver is a mark on its
node, never an error of the job).
"""

from __future__ import annotations

import os

from .system import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import GpusRequest

QUERY = ["--query-gpu=index,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"]


def _number(text: str) -> int | None:
    """A field of nvidia-smi's csv: an integer, or None for ``[N/A]``/``[Not Supported]`` (MIG, some boards)."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return None
    return int(float(text))


def parse_gpus(text: str) -> list[dict[str, Any]]:
    """The GPUs of ``nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total
    --format=csv,noheader,nounits``; ``ValueError`` quoting the first line that is not such a row."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split(",")
        try:
            if len(fields) != 4:
                raise ValueError(line)
            index = int(fields[0])
            util, used, total = (_number(f) for f in fields[1:])
        except ValueError:
            raise ValueError(f"nvidia-smi printed {line[:120]!r}, not index, utilization, memory used, total")\
                from None
        gpus.append({"index": index, "util": util, "mem_used": used, "mem_total": total})
    return gpus


def op_gpus(req: GpusRequest) -> dict[str, Any]:
    path = which("nvidia-smi")
    if path is None:
        return {"ok": True, "found": False, "gpus": [], "problem": ""}
    import subprocess

    try:
        done = subprocess.run([path, *QUERY], stdin=subprocess.DEVNULL, capture_output=True, timeout=req.timeout,
                              env=dict(os.environ, LC_ALL="C"))
    except subprocess.TimeoutExpired:
        return {"ok": True, "found": True, "gpus": [], "problem": f"nvidia-smi did not answer within {req.timeout:g} s"}
    except OSError as exc:
        return {"ok": True, "found": True, "gpus": [], "problem": f"{path}: {exc.strerror or exc}"}
    out = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode("utf-8", "replace").strip().splitlines()
        return {"ok": True, "found": True, "gpus": [],
                "problem": f"nvidia-smi exited with status {done.returncode}" + (f": {said[-1][:200]}" if said else "")}
    try:
        gpus = parse_gpus(out)
    except ValueError as exc:
        return {"ok": True, "found": True, "gpus": [], "problem": str(exc)}
    return {"ok": True, "found": True, "gpus": gpus, "problem": "" if gpus else "nvidia-smi lists no GPU"}
