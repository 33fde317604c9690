"""How fast this machine steps the model, measured before a live session opens.

`talk` says from it whether the device keeps up in real time; `serve` will say how many
callers it can take. The first steps after loading or a fresh `start()` pay one-off costs
(allocations, caches, CUDA graph capture) and, on a busy machine, run several times slower
than the session will: they are stepped but not counted. What is counted is enough frames
for a median and a spread, within a time limit, so that a slow device (the 7B model on a
CPU takes seconds per frame) measures fewer frames rather than stalling the start.

The step is fed silence; what it answers is thrown away (the caller starts the
conversation afresh afterwards). Only numpy and the standard library are imported here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..core.config import FRAME_MS, FRAME_SIZE

SKIPPED_FRAMES = 5  # stepped first, not counted
MEASURED_FRAMES = 30  # 2.4 s of audio
MAX_SECONDS = 6.0  # the whole warm-up, unless that leaves fewer than MIN_MEASURED frames
MIN_MEASURED = 3
# The 7B model has ~7e9 parameters; the test and benchmark models are far smaller, and
# are not "far too slow on a CPU".
FULL_SIZE_PARAMETERS = 5e9


@dataclass(frozen=True)
class StepTimes:
    """Milliseconds per step over the counted frames: the median and 8 in 10 between
    p10 and p90."""

    p10_ms: float
    p50_ms: float
    p90_ms: float
    frames: int

    @property
    def rtf(self) -> float:
        """The median step over the 80 ms it must take at most: below 1 keeps up."""
        return self.p50_ms / FRAME_MS


def time_steps(step: Callable[[np.ndarray], object], batch: int = 1, *,
               skipped: int = SKIPPED_FRAMES, measured: int = MEASURED_FRAMES,
               max_s: float = MAX_SECONDS, clock: Callable[[], float] = time.perf_counter
               ) -> StepTimes:
    """Steps `step` (a Conversation's, or anything taking [batch, 1920] float32) on silence:
    `skipped` frames (fewer once a third of `max_s` has gone), then up to `measured` counted
    ones, until `max_s` has passed with at least MIN_MEASURED counted."""
    silence = np.zeros((batch, FRAME_SIZE), np.float32)
    began = clock()
    for _ in range(skipped):
        step(silence)
        if clock() - began > max_s / 3:
            break
    times: list[float] = []
    while len(times) < measured:
        t = clock()
        step(silence)
        times.append(1000.0 * (clock() - t))
        if len(times) >= MIN_MEASURED and clock() - began > max_s:
            break
    p10, p50, p90 = np.percentile(times, [10, 50, 90])
    return StepTimes(float(p10), float(p50), float(p90), len(times))


def verdict(times: StepTimes, device: str, parameters: int) -> str:
    """One line: what was measured and whether this device keeps up. The hint that a GPU
    is needed is given for the full-size model on a CPU only."""
    head = (f"warm-up: {times.p50_ms:.0f} ms per 80 ms frame on {device} (median of "
            f"{times.frames} frames, 8 in 10 within {times.p10_ms:.0f}-{times.p90_ms:.0f} ms;"
            f" real-time factor {times.rtf:.2f})")
    if times.rtf <= 0.7 and times.p90_ms <= FRAME_MS:
        return f"{head}: keeps up"
    if times.rtf <= 1.0:
        return f"{head}: keeps up, barely; on a busy machine some caller audio may be dropped"
    why = ""
    if device == "cpu" and parameters >= FULL_SIZE_PARAMETERS:
        why = " (on a CPU the full-size model is far too slow; use a GPU)"
    return (f"{head}: this device cannot keep up with the model in real time{why}; caller "
            "audio will be dropped to keep latency bounded")
