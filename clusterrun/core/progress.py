"""The training's progress as the controller carries it (``Progress``), and how a person reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from clusterrun.core.frozen import frozen

POINTS = 256  # (step, loss) points a curve keeps at most: the agent's bound too (agent/progress.py, stdlib-only)
Point = tuple[float, float]  # (step, loss)
Mark = tuple[int, float, float]  # (attempt, step, loss)


def duration_words(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``, ``2.1 d``: a time left, as a person reads it at a glance."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} d"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _numbers(row: Any, size: int) -> tuple[float, ...] | None:
    if not isinstance(row, (list, tuple)) or len(row) != size:
        return None
    values = tuple(_number(v) for v in row)
    return None if None in values else values  # type: ignore[return-value]


def _rows(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _curve(data: Any) -> tuple[Point, ...]:
    """A curve as the agent (or a record) writes it: ``{points: [[step, loss], ...], latest: [step, loss]}``."""
    if not isinstance(data, dict):
        return ()
    points = [p for p in (_numbers(row, 2) for row in _rows(data.get("points"))) if p is not None]
    latest = _numbers(data.get("latest"), 2)
    if latest is not None and (not points or latest[0] > points[-1][0]):
        points.append(latest)
    return tuple(points)  # type: ignore[arg-type]


def thin(marks: Sequence[Mark], limit: int = POINTS) -> tuple[Mark, ...]:
    """``marks`` within ``limit``: every other point dropped, each attempt's last one kept, until they fit
    (the oldest go where attempts alone are more than ``limit``)."""
    kept = list(marks)
    while len(kept) > limit:
        fewer = [m for i, m in enumerate(kept) if i % 2 == 0 or i == len(kept) - 1 or kept[i + 1][0] != m[0]]
        kept = fewer if len(fewer) < len(kept) else kept[-limit:]
    return tuple(kept)


@frozen
class Progress:
    """The training's progress as rank 0's output shows it (read on its host: ``agent/progress.py``):
    ``step`` of ``total``, ``per_second``, ``eta_seconds``, the last ``metrics`` (loss, ...) by name,
    ``updated`` (wall clock) and the ``attempt`` that printed it (a resumed run goes on from its step);
    ``curve``: that attempt's loss by step (bounded, evenly spread: ``agent/progress.py``'s ``Curve``),
    ``earlier``: the curves of the attempts before it, as the job's record kept them."""

    step: float | None = None
    total: float | None = None
    per_second: float | None = None
    eta_seconds: float | None = None
    metrics: tuple[tuple[str, float], ...] = ()
    updated: float | None = None
    attempt: int | None = None
    unit: str = "step"  # what ``step`` counts: "step", or "epoch" where the output counts nothing finer
    curve: tuple[Point, ...] = ()
    earlier: tuple[Mark, ...] = ()

    @property
    def series(self) -> tuple[Mark, ...]:
        """Every attempt's loss by step, (attempt, step, loss), the earliest first."""
        return self.earlier + tuple((self.attempt or 0, step, loss) for step, loss in self.curve)

    def after(self, before: Progress | None) -> Progress:
        """This reading with the curves of the attempts before its own (``before``: the record's last reading)."""
        if before is None:
            return self
        if before.attempt == self.attempt:
            return dataclasses.replace(self, earlier=before.earlier)
        return dataclasses.replace(self, earlier=thin([m for m in before.series if m[0] != self.attempt]))

    @property
    def loss(self) -> float | None:
        named = dict(self.metrics)
        return next((named[k] for k in ("loss", "train_loss") if k in named), None)

    def to_json(self) -> dict[str, Any]:
        def whole(value: float | None) -> float | int | None:
            return int(value) if value is not None and value == int(value) else value

        return {"step": whole(self.step), "total": whole(self.total), "per_second": self.per_second,
                "eta_seconds": self.eta_seconds, "metrics": dict(self.metrics), "updated": self.updated,
                "attempt": self.attempt, "unit": self.unit, "curve": {"points": [list(p) for p in self.curve]},
                "earlier": [list(m) for m in self.earlier]}

    @classmethod
    def from_json(cls, data: Any, attempt: int | None = None) -> Progress | None:
        """What a host's state or a record holds (None where it holds nothing usable)."""
        if not isinstance(data, dict):
            return None
        metrics = data.get("metrics")
        metrics = metrics if isinstance(metrics, dict) else {}
        kept = tuple((str(k), float(v)) for k, v in metrics.items() if _number(v) is not None)
        earlier = tuple((int(m[0]), m[1], m[2]) for m in (_numbers(row, 3) for row in _rows(data.get("earlier")))
                        if m is not None)
        found = cls(_number(data.get("step")), _number(data.get("total")), _number(data.get("per_second")),
                    _number(data.get("eta_seconds")), kept, _number(data.get("updated")),
                    attempt if attempt is not None else data.get("attempt") if isinstance(data.get("attempt"), int)
                    else None, "epoch" if data.get("unit") == "epoch" else "step", _curve(data.get("curve")), earlier)
        return found if found.step is not None or found.metrics else None

    @property
    def shown_step(self) -> float | None:
        """The step worth showing: none for step 0 of a known epoch without a total (an output that
        prints only each epoch's first step, ``Epoch 4 | Iter 0``, says the epoch and nothing finer)."""
        if self.step == 0 and not self.total and self.unit == "step" and "epoch" in dict(self.metrics):
            return None
        return self.step

    def cell(self, ended: bool = False) -> str:
        """``ps``'s PROGRESS cell: ``450/1000 45% loss 2.31 ETA 12 s``, ``epoch 3: 450/1000 ...`` where
        the step counts within an epoch; no ETA once the job has ``ended``."""
        parts = []
        epoch, step = dict(self.metrics).get("epoch"), self.shown_step
        if epoch is not None and self.unit == "step":
            parts.append(f"epoch {epoch:g}" + (":" if step is not None else ""))
        if step is not None:
            parts.append(("epoch " if self.unit == "epoch" else "") + f"{step:g}"
                         + (f"/{self.total:g} {100 * step / self.total:.0f}%" if self.total else ""))
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4g}")
        if self.eta_seconds is not None and self.total and not ended:
            parts.append(f"ETA {duration_words(self.eta_seconds)}")
        return " ".join(parts)

    def text(self) -> str:
        """``step 450/1000 (45%), 45.0 steps/s, loss 2.31, ETA 12 s``."""
        parts = []
        if self.shown_step is not None:
            step = f"{self.unit} {self.shown_step:g}" + (f"/{self.total:g}" if self.total else "")
            parts.append(step + (f" ({100 * self.shown_step / self.total:.0f}%)" if self.total else ""))
        if self.per_second:
            parts.append(f"{self.per_second:.3g} {self.unit}s/s" if self.per_second >= 1 else
                         f"{1 / self.per_second:.3g} s/{self.unit}")
        named = dict(self.metrics)
        parts += [f"{k.replace('_', ' ')} {named[k]:.4g}"
                  for k in ("epoch", "loss", "train_loss", "val_loss", "eval_loss") if k in named]
        if self.eta_seconds is not None and self.total:
            parts.append(f"ETA {duration_words(self.eta_seconds)}")
        return ", ".join(parts)
