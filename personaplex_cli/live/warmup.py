"""talk's verdict on the warm-up: whether this device keeps up with a live session.

The warm-up itself (the thread decision, the timing, the one measure of step times) is
runtime/warmup.py's, shared with serve and reply. Only the standard library is imported here.
"""

from __future__ import annotations

from ..runtime.warmup import FRAME_MS, REAL_TIME_SHARE, StepTimes, Threads

# The 7B model has ~7e9 parameters; the test and benchmark models are far smaller, and
# are not "far too slow on a CPU".
FULL_SIZE_PARAMETERS = 5e9


def verdict(times: StepTimes, device: str, parameters: int,
            threads: Threads | None = None) -> str:
    """One line: what was measured and whether this device keeps up. The hint that a GPU
    is needed is given for the full-size model on a CPU only."""
    on = device if threads is None else f"{device} with {threads.text()}"
    head = (f"warm-up: {times.p50_ms:.0f} ms per 80 ms frame on {on} (median of "
            f"{times.frames} frames, 8 in 10 within {times.p10_ms:.0f}-{times.p90_ms:.0f} ms;"
            f" real-time factor {times.rtf:.2f})")
    if times.rtf <= REAL_TIME_SHARE and times.p90_ms <= FRAME_MS:
        return f"{head}: keeps up"
    if times.rtf <= 1.0:
        return f"{head}: keeps up, barely; on a busy machine some caller audio may be dropped"
    why = ""
    if device == "cpu" and parameters >= FULL_SIZE_PARAMETERS:
        why = " (on a CPU the full-size model is far too slow; use a GPU)"
    return (f"{head}: this device cannot keep up with the model in real time{why}; caller "
            "audio will be dropped to keep latency bounded")
