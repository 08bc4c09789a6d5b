"""The training's progress as the controller carries it (``Progress``), and how a person reads it."""

from __future__ import annotations

from typing import Any

from clusterrun.core.frozen import frozen


def duration_words(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``, ``2.1 d``: a time left, as a person reads it at a glance."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} d"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@frozen
class Progress:
    """The training's progress as rank 0's output shows it (read on its host: ``agent/progress.py``):
    ``step`` of ``total``, ``per_second``, ``eta_seconds``, the last ``metrics`` (loss, ...) by name,
    ``updated`` (wall clock) and the ``attempt`` that printed it (a resumed run goes on from its step)."""

    step: float | None = None
    total: float | None = None
    per_second: float | None = None
    eta_seconds: float | None = None
    metrics: tuple[tuple[str, float], ...] = ()
    updated: float | None = None
    attempt: int | None = None
    unit: str = "step"  # what ``step`` counts: "step", or "epoch" where the output counts nothing finer

    @property
    def loss(self) -> float | None:
        named = dict(self.metrics)
        return next((named[k] for k in ("loss", "train_loss") if k in named), None)

    def to_json(self) -> dict[str, Any]:
        def whole(value: float | None) -> float | int | None:
            return int(value) if value is not None and value == int(value) else value

        return {"step": whole(self.step), "total": whole(self.total), "per_second": self.per_second,
                "eta_seconds": self.eta_seconds, "metrics": dict(self.metrics), "updated": self.updated,
                "attempt": self.attempt, "unit": self.unit}

    @classmethod
    def from_json(cls, data: Any, attempt: int | None = None) -> Progress | None:
        """What a host's state or a record holds (None where it holds nothing usable)."""
        if not isinstance(data, dict):
            return None
        metrics = data.get("metrics")
        metrics = metrics if isinstance(metrics, dict) else {}
        kept = tuple((str(k), float(v)) for k, v in metrics.items() if _number(v) is not None)
        found = cls(_number(data.get("step")), _number(data.get("total")), _number(data.get("per_second")),
                    _number(data.get("eta_seconds")), kept, _number(data.get("updated")),
                    attempt if attempt is not None else data.get("attempt") if isinstance(data.get("attempt"), int)
                    else None, "epoch" if data.get("unit") == "epoch" else "step")
        return found if found.step is not None or found.metrics else None

    def text(self) -> str:
        """``step 450/1000 (45%), 45.0 steps/s, loss 2.31, ETA 12 s``."""
        parts = []
        if self.step is not None:
            step = f"{self.unit} {self.step:g}" + (f"/{self.total:g}" if self.total else "")
            parts.append(step + (f" ({100 * self.step / self.total:.0f}%)" if self.total else ""))
        if self.per_second:
            parts.append(f"{self.per_second:.3g} {self.unit}s/s" if self.per_second >= 1 else
                         f"{1 / self.per_second:.3g} s/{self.unit}")
        named = dict(self.metrics)
        parts += [f"{k.replace('_', ' ')} {named[k]:.4g}" for k in ("epoch", "loss", "train_loss", "val_loss")
                  if k in named]
        if self.eta_seconds is not None and self.total:
            parts.append(f"ETA {duration_words(self.eta_seconds)}")
        return ", ".join(parts)
