"""The one statistics object of a running scheduler: serve's /metrics, talk's live line and
reply's progress all read `StepStats`.

Only numpy and the standard library: talk's view reads it without loading torch.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from ..core.config import FRAME_MS
from ..histogram import Histogram
from .warmup import percentile_ms

STEP_TIMES_KEPT = 2048  # steps behind the windowed p50/p99 figures (164 s of real time)


@dataclass
class StepStats:
    """What the scheduler counts, one writer (its thread), read from any other: plain
    numbers and bounded deques.

    The step-time percentiles are the warm-up's measure (runtime.warmup.percentile_ms) over
    the last STEP_TIMES_KEPT steps, or over those of the last `window_s` seconds; the
    session's, in constant memory, come from a histogram of every step."""

    steps: int = 0
    frames: int = 0  # row-frames stepped: a step of B live rows counts B
    late: int = 0  # row-frames stepped on silence because the caller's frame was late
    overruns: int = 0  # ticks that ended after the next one was due (tick pacing)
    primed_frames: int = 0
    prime_cost_s: float = 0.0  # measured seconds per primer step
    step_times: collections.deque = field(  # seconds per step
        default_factory=lambda: collections.deque(maxlen=STEP_TIMES_KEPT))
    step_ended: collections.deque = field(  # time.monotonic() at each step's end
        default_factory=lambda: collections.deque(maxlen=STEP_TIMES_KEPT))
    session: Histogram = field(default_factory=Histogram.durations_ms)

    def record_step(self, seconds: float, rows: int) -> None:
        """One step of `rows` rows took `seconds`."""
        self.step_times.append(seconds)
        self.step_ended.append(time.monotonic())
        self.session.add(1000.0 * seconds)
        self.steps += 1
        self.frames += rows

    def step_ms(self, quantile: float, window_s: float | None = None) -> float | None:
        """The steps' ms at `quantile` (None before any step): over the kept steps, or
        those that ended in the last `window_s` seconds."""
        times = list(self.step_times)
        if window_s is not None:
            since = time.monotonic() - window_s
            ended = list(self.step_ended)[-len(times):]
            times = [t for t, end in zip(times, ended) if end >= since]
        return percentile_ms((1000.0 * t for t in times), quantile)

    def session_ms(self, quantile: float) -> float | None:
        """The whole session's steps' ms at `quantile`, to the histogram's 1 %."""
        return self.session.percentile(100.0 * quantile)

    def real_time_factor(self, window_s: float | None = None) -> float | None:
        """The median step over the 80 ms frame: below 1 keeps up."""
        p50 = self.step_ms(0.5, window_s)
        return None if p50 is None else p50 / FRAME_MS
