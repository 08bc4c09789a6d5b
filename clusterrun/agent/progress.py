"""Training progress read from a rank's output: the step (of a total), steps per second, the ETA and
the last metrics (loss, ...), with no change to the user's script.

Known formats, tried in this order on every line (and on every carriage-return segment of one, as
progress bars redraw themselves): a hosts file's own ``progress:`` pattern (a regular expression
with named groups ``step``, ``total`` and any metric, e.g. ``loss``); tqdm's bars, Lightning's and
HuggingFace Trainer's among them (``Epoch 3:  45%|████▌ | 450/1000 [00:10<00:12, 45.0it/s, loss=2.31]``);
HuggingFace Trainer's logged dicts (``{'loss': 2.31, 'learning_rate': 5e-05, 'epoch': 0.45}``);
pytorch/examples' ``Train Epoch: 1 [640/60000 (1%)]	Loss: 2.28`` and ``Epoch: [0][ 10/5005] ... Loss 6.9``;
and a line with a step and a loss, as nanoGPT (``iter 120: loss 2.3051, time 45.02ms``) and torchtitan
(``step: 10  loss:  8.1234``) print them, or with a count of batches, as pytorch/examples' language model
(``| epoch   1 |   200/ 2983 batches | ... | ms/batch 45.60 | loss  7.63``). A line that is none of these
changes nothing.

``Tracker`` keeps the latest reading; ``to_json()`` is what state.json's ``progress`` holds:
``{step, total, per_second, eta_seconds, metrics, updated, unit, curve}`` (``unit``: ``epoch`` where the
output counts epochs and nothing finer, else ``step``; ``curve``: the loss by step, ``Curve``). Steps
per second come from the line where it says (a bar's rate, nanoGPT's time per iteration), else from
the steps seen in the last ``WINDOW`` seconds. Stdlib only: it runs in the agent's monitor on the host.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

POINTS = 256  # (step, loss) points a curve keeps at most (then every other one goes): ~5 kB in state.json
WINDOW = 120.0  # seconds of readings the rate is computed over, where the line gives none
MAX_SEGMENT = 4096  # a longer segment is no progress line: not searched (a rank may print megabytes at once)
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SCALE = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}

# tqdm's {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}], or without a total
# {n_fmt}{unit} [{elapsed}, {rate_fmt}{postfix}]; rate_fmt is N{unit}/s or N s/{unit}, or ?{unit}/s.
TQDM = re.compile(
    r"(?:(?P<desc>[^|]*?):?\s*\d+%\|[^|]*\|\s*)?"
    r"(?P<n>\d+(?:\.\d+)?[kMGT]?)(?:/(?P<total>\d+(?:\.\d+)?[kMGT]?))?[a-zA-Z]*\s*"
    r"\[(?P<elapsed>[\d:]+)(?:<(?P<remaining>[\d:]+|\?))?,\s*"
    r"(?:(?P<rate>\d+(?:\.\d+)?)(?P<per>s/)?[a-zA-Z]*(?:/s)?|\?[a-zA-Z]*/s)"
    r"(?:,\s*(?P<postfix>[^\]]*))?\]\s*$")
POSTFIX = re.compile(rf"(\w+)=({NUMBER})")
HF_DICT = re.compile(r"^\s*\{'[A-Za-z_]\w*': .*\}\s*$")
HF_ITEM = re.compile(rf"'([A-Za-z_][\w/]*)': '?({NUMBER})'?")
EXAMPLES_MNIST = re.compile(  # pytorch/examples' mnist
    rf"Train Epoch: (?P<epoch>\d+) \[(?P<step>\d+)/(?P<total>\d+) \(\d+%\)\]\s+Loss: (?P<loss>{NUMBER})")
EXAMPLES_METER = re.compile(  # pytorch/examples' ProgressMeter (imagenet)
    rf"Epoch: \[(?P<epoch>\d+)\]\[\s*(?P<step>\d+)/(?P<total>\d+)\].*?\bLoss\s+(?P<loss>{NUMBER})")
STEP = re.compile(r"\b(?:global[_ ]step|step|iter|iteration)\b\s*[:=#]?\s*(?P<step>\d+)(?:\s*/\s*(?P<total>\d+))?",
                  re.IGNORECASE)
EPOCH = re.compile(r"\bepoch\b\s*[:=#]?\s*(?P<epoch>\d+)(?:\s*/\s*(?P<total>\d+))?", re.IGNORECASE)
LOSS = re.compile(rf"\b(?P<name>(?:train[_ ]|val[_ ]|eval[_ ])?loss)\b\s*[:=]?\s*(?P<loss>{NUMBER})", re.IGNORECASE)
BATCHES = re.compile(r"\b(?P<step>\d+)\s*/\s*(?P<total>\d+)\s+(?:batches|batch|steps|iterations|iters)\b")
TIME_MS = re.compile(rf"\btime\s*[:=]?\s*(?P<ms>{NUMBER})\s*ms\b|\bms/(?:batch|step|iter)\s*[:=]?\s*(?P<per>{NUMBER})")


def _count(text: str) -> float:
    """tqdm's unit-scaled count (``1.2k``) as a number."""
    return float(text[:-1]) * SCALE[text[-1]] if text[-1] in SCALE else float(text)


def _seconds(clock: str) -> float:
    """tqdm's ``[H:]MM:SS`` as seconds."""
    total = 0.0
    for part in clock.split(":"):
        total = total * 60 + float(part)
    return total


def _metrics(pairs: Any) -> dict[str, float]:
    return {name.strip().replace(" ", "_").lower(): float(value) for name, value in pairs}


class Reading:
    """What one line said: a step (maybe of a total), maybe a rate and a time left, and metrics."""

    __slots__ = ("step", "total", "per_second", "eta_seconds", "metrics", "unit")

    def __init__(self, step: float | None, total: float | None = None, per_second: float | None = None,
                 eta_seconds: float | None = None, metrics: dict[str, float] | None = None, unit: str = "step") -> None:
        self.step, self.total, self.per_second, self.eta_seconds = step, total, per_second, eta_seconds
        self.metrics = metrics or {}
        self.unit = unit  # what is counted: "step", or "epoch" where a line counts nothing finer


def parse(segment: str, pattern: re.Pattern[str] | None = None) -> Reading | None:
    """The progress ``segment`` (one line, or one carriage-return segment of it) reports, or None."""
    if len(segment) > MAX_SEGMENT:
        return None
    text = ANSI.sub("", segment)
    if pattern is not None:
        found = pattern.search(text)
        if found is None:
            return None
        groups = {k: v for k, v in found.groupdict().items() if v is not None}
        step, total = groups.pop("step", None), groups.pop("total", None)
        numbers = {k: v for k, v in groups.items() if re.fullmatch(NUMBER, v)}
        return Reading(float(step) if step is not None else None, float(total) if total is not None else None,
                       metrics=_metrics(numbers.items()))
    return _tqdm(text) or _hf_dict(text) or _examples(text) or _step_and_loss(text)


def _tqdm(text: str) -> Reading | None:
    found = TQDM.search(text)
    if found is None or "[" not in text:
        return None
    rate = float(found["rate"]) if found["rate"] else None
    if rate is not None and found["per"]:  # "2.50s/it": seconds per step
        rate = 1 / rate if rate else None
    metrics = _metrics(POSTFIX.findall(found["postfix"] or ""))
    epoch = re.search(r"\bEpoch (\d+)", found["desc"] or "")
    if epoch:  # Lightning's bar: "Epoch 3: ..."
        metrics["epoch"] = float(epoch[1])
    remaining = found["remaining"]
    return Reading(_count(found["n"]), _count(found["total"]) if found["total"] else None, rate,
                   _seconds(remaining) if remaining and remaining != "?" else None, metrics)


def _hf_dict(text: str) -> Reading | None:
    if not HF_DICT.match(text):
        return None
    metrics = _metrics(HF_ITEM.findall(text))
    return Reading(None, metrics=metrics) if metrics else None


def _examples(text: str) -> Reading | None:
    found = EXAMPLES_MNIST.search(text) or EXAMPLES_METER.search(text)
    if found is None:
        return None
    return Reading(float(found["step"]), float(found["total"]),
                   metrics={"epoch": float(found["epoch"]), "loss": float(found["loss"])})


def _step_and_loss(text: str) -> Reading | None:
    """A line with a loss and a step (or, lacking one, an epoch) counts that step."""
    if LOSS.search(text) is None:
        return None
    step, epoch = STEP.search(text) or BATCHES.search(text), EPOCH.search(text)
    count = step or epoch
    if count is None:
        return None
    metrics = _metrics((m["name"], m["loss"]) for m in LOSS.finditer(text))
    if epoch is not None and step is not None:
        metrics["epoch"] = float(epoch["epoch"])
    time_ms = TIME_MS.search(text)
    ms = float(time_ms["ms"] or time_ms["per"]) if time_ms else 0.0
    per_second = 1000 / ms if ms > 0 else None
    return Reading(float(count[1]), float(count["total"]) if count["total"] else None, per_second, metrics=metrics,
                   unit="step" if step is not None else "epoch")


class Curve:
    """The loss by step of one attempt, bounded on a days-long run: every reading with a loss is kept
    until there are ``POINTS``, then every other point is dropped and the spacing between kept steps
    doubles, so the points stay evenly spread over the whole run; the latest reading is always shown.

    A step lower than the last one is a bar that starts again: the next epoch's (its ``epoch`` metric
    went up) goes on after the last step (at least one step on: an output that prints only a bar's
    first step, ``Epoch 4 | Iter 0``, is a point per epoch); otherwise the run went back to a
    checkpoint, and the points after it are dropped (the curve shows what the model went through)."""

    def __init__(self, start: dict[str, Any] | None = None) -> None:
        start = start or {}
        self.points: list[list[float]] = [list(p) for p in start.get("points") or () if len(p) == 2]
        self.spacing = float(start.get("spacing") or 0.0)  # steps between two kept points, at least
        self.offset = float(start.get("offset") or 0.0)  # added to a bar's step: the epochs before it
        self.latest: list[float] | None = start.get("latest")  # a reading closer than ``spacing``: shown, not kept
        self.last: tuple[float, float | None] | None = None  # (step, epoch) as the output printed them last

    def add(self, step: float, loss: float, epoch: float | None) -> None:
        next_epoch = self.last is not None and epoch is not None and self.last[1] is not None and epoch > self.last[1]
        if self.last is not None and (step < self.last[0] or step == self.last[0] and next_epoch):
            if next_epoch:
                self.offset += max(self.last[0], 1.0)
            else:
                self.points = [p for p in self.points if p[0] < step + self.offset]
                self.latest = None
        self.last = (step, epoch)
        x = step + self.offset
        if self.points and x - self.points[-1][0] < self.spacing:
            self.latest = [x, loss]  # rounded when written (to_json): most readings of a long run end here
            return
        self.latest = None
        y = _rounded(loss)
        if self.points and x == self.points[-1][0]:
            self.points[-1] = [x, y]
            return
        self.points.append([x, y])
        if len(self.points) > POINTS:
            self.points = self.points[::2]
            self.spacing = (self.points[-1][0] - self.points[0][0]) / max(1, len(self.points) - 1)

    def to_json(self) -> dict[str, Any]:
        def whole(value: float) -> float | int:
            return int(value) if value == int(value) else value

        return {"points": [[whole(x), y] for x, y in self.points], "spacing": self.spacing, "offset": self.offset,
                "latest": [whole(self.latest[0]), _rounded(self.latest[1])] if self.latest else None}


def _rounded(loss: float) -> float:
    """A loss as the curve keeps it: 6 significant digits."""
    return float(f"{loss:.6g}")


class Tracker:
    """The latest progress of one rank's output. Lifecycle: ``Tracker(pattern)`` → ``feed(data, now)``
    for every chunk written (bytes, any split) → ``to_json()``; ``feed`` says whether it changed."""

    def __init__(self, pattern: str | None = None, start: dict[str, Any] | None = None) -> None:
        self.pattern = re.compile(pattern) if pattern else None
        self._partial = ""
        self._seen: list[tuple[float, float]] = []  # (time, step) of the last WINDOW seconds
        self.step: float | None = None
        self.total: float | None = None
        self.per_second: float | None = None
        self.eta_seconds: float | None = None
        self.metrics: dict[str, float] = {}
        self.updated: float | None = None
        self.unit = "step"
        self.curve = Curve((start or {}).get("curve"))
        if start:  # a monitor that resumes: what its predecessor saw
            self.step, self.total, self.updated = start.get("step"), start.get("total"), start.get("updated")
            self.metrics = dict(start.get("metrics") or {})
            self.unit = start.get("unit") or "step"

    def feed(self, data: bytes, now: float) -> bool:
        """Read ``data``, the next bytes of the output; True if the progress changed. The last segment
        is read even without its line's end (a bar redraws itself in place) and again once complete."""
        text = self._partial + data.decode("utf-8", "replace")
        segments = re.split(r"[\r\n]", text)
        self._partial = segments[-1][-MAX_SEGMENT:]
        changed = False
        for segment in segments:
            if segment.strip():
                reading = parse(segment, self.pattern)
                if reading is not None:
                    changed |= self._take(reading, now)
        return changed

    def _take(self, reading: Reading, now: float) -> bool:
        before = (self.step, self.total, self.metrics)
        self.metrics = {**self.metrics, **reading.metrics}
        if reading.total is not None:
            self.total = reading.total
        if reading.step is not None:
            if self.step is not None and reading.step < self.step:
                self._seen.clear()  # a new epoch's bar, or a restarted count: the rate starts again
            self.step, self.unit = reading.step, reading.unit
            self._seen = [(t, s) for t, s in self._seen if now - t <= WINDOW] + [(now, reading.step)]
            self.per_second = reading.per_second if reading.per_second is not None else self._rate()
            if reading.eta_seconds is not None:
                self.eta_seconds = reading.eta_seconds
            elif self.total is not None and self.per_second:
                self.eta_seconds = max(0.0, (self.total - self.step) / self.per_second)
            else:
                self.eta_seconds = None
        loss = next((reading.metrics[k] for k in ("loss", "train_loss") if k in reading.metrics), None)
        if loss is not None and self.step is not None:
            self.curve.add(self.step, loss, self.metrics.get("epoch"))
        changed = (self.step, self.total, self.metrics) != before
        if changed:
            self.updated = now
        return changed

    def _rate(self) -> float | None:
        (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 >= s0 else None

    def to_json(self) -> dict[str, Any] | None:
        if self.step is None and not self.metrics:
            return None

        def whole(value: float | None) -> float | int | None:
            return int(value) if value is not None and value == int(value) else value

        return {"step": whole(self.step), "total": whole(self.total),
                "per_second": round(self.per_second, 4) if self.per_second is not None else None,
                "eta_seconds": round(self.eta_seconds, 1) if self.eta_seconds is not None else None,
                "metrics": {k: round(v, 6) for k, v in self.metrics.items()}, "updated": self.updated,
                "unit": self.unit, "curve": self.curve.to_json()}
