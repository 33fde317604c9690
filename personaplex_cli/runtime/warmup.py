"""The one warm-up: how fast this machine steps the model as the session will run it, and
what every command takes from that: torch's thread count and how many rows keep real time.

Measured before a session opens, on the session's own batch (its slots, its persona primed,
so priming is timed too), fed silence; what it answers is thrown away. The first steps after
loading pay one-off costs (allocations, caches, CUDA graph capture) and are stepped but not
counted. What is counted is enough frames for a median and a spread, within a time limit, so
that a slow device (the 7B model on a CPU takes seconds per frame) measures fewer frames
rather than stalling the start.

Threads: on a CPU, torch's default (one per core) spins its workers against each other and
against whatever else the machine runs, and a step on more threads can take several times as
long as on one (the README's Performance section has the figures). So each thread count in
1, 2, 4, ... up to the cores is tried, in turn, a few frames at a time over several rounds (a load that comes and goes
hits every candidate alike), and the fastest median is kept: more threads only when they
are clearly faster. OMP_NUM_THREADS, when set, is the user's decision and is kept as given.

Real time: a step keeps real time when its median takes at most REAL_TIME_SHARE of the frame
(`real_time_rows`): the one rule by which serve sizes its sessions, talk says whether the
device keeps up (`verdict`) and doctor --bench counts callers.

`percentile_ms` is the one measure of step times: the warm-up's verdict and the session's own
figures (serve's /metrics and summary, talk's live line) are computed by it, so they agree.
Only numpy and the standard library are imported at module level.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.config import FRAME_MS, FRAME_SIZE

SKIPPED_FRAMES = 5  # stepped first, not counted
MEASURED_FRAMES = 30  # 2.4 s of audio
MAX_SECONDS = 6.0  # one measurement, unless that leaves fewer than MIN_MEASURED frames
MIN_MEASURED = 3
THREAD_ROUNDS = 3  # each candidate is timed once per round, the rounds interleaved
THREAD_ROUND_FRAMES = 4
THREAD_TRIAL_MAX_S = 6.0  # the whole thread trial; a slow device tries fewer rounds
MORE_THREADS_GAIN = 0.9  # more threads are kept only at under 90% of fewer threads' step
# A step keeps real time when its median takes at most this share of the frame: the rest
# is for priming newcomers, the caller's audio coding and the machine's other work.
REAL_TIME_SHARE = 0.7
STEP_BUDGET_MS = REAL_TIME_SHARE * FRAME_MS
SWEEP_MAX_S = 30.0  # the sweep of row counts: a slow device measures fewer of them
SWEEP_FRAMES = 8  # counted steps per row count in the sweep, after SWEEP_SKIPPED
SWEEP_SKIPPED = 3
# The 7B model has ~7e9 parameters; the test and benchmark models are far smaller, and are
# not "far too slow on a CPU".
FULL_SIZE_PARAMETERS = 5e9
THREADS_VARIABLE = "OMP_NUM_THREADS"
THREADS_FILE = "threads.json"  # under the project's cache dir: ThreadsMemory


def percentile_ms(times_ms: Iterable[float], quantile: float) -> float | None:
    """The one measure of a run of step times: numpy's linear percentile (None for none)."""
    times = np.fromiter(times_ms, float)
    return float(np.percentile(times, 100.0 * quantile)) if times.size else None


@dataclass(frozen=True)
class StepTimes:
    """Milliseconds per step: the median, 8 in 10 between p10 and p90, and p99."""

    p10_ms: float
    p50_ms: float
    p90_ms: float
    frames: int
    p99_ms: float | None = field(default=None, compare=False)  # the spread's tail, shown

    @classmethod
    def of(cls, times_ms: Iterable[float]) -> StepTimes | None:
        """p10, p50, p90 and p99 by `percentile_ms` (None for no times)."""
        times = list(times_ms)
        if not times:
            return None
        p10, p50, p90, p99 = (percentile_ms(times, q) for q in (0.1, 0.5, 0.9, 0.99))
        return cls(p10, p50, p90, len(times), p99)

    @property
    def rtf(self) -> float:
        """The median step over the 80 ms it must take at most: below 1 keeps up."""
        return self.p50_ms / FRAME_MS


def time_steps(step: Callable[[np.ndarray], object], batch: int = 1, *,
               skipped: int = SKIPPED_FRAMES, measured: int = MEASURED_FRAMES,
               max_s: float = MAX_SECONDS, clock: Callable[[], float] = time.perf_counter
               ) -> StepTimes:
    """Steps `step` (anything taking [batch, 1920] float32) on silence: `skipped` frames
    (fewer once a third of `max_s` has gone), then up to `measured` counted ones, until
    `max_s` has passed with at least MIN_MEASURED counted."""
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
    return StepTimes.of(times)


# -- threads --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Threads:
    """torch's intra-op thread count for every command, and why."""

    count: int
    tried_ms: Mapping[int, float] = field(default_factory=dict)  # threads -> median step
    given: str | None = None  # who decided otherwise (the environment, a GPU)

    def text(self) -> str:
        head = f"{self.count} torch thread{'' if self.count == 1 else 's'}"
        if self.given:
            return f"{head} ({self.given})"
        if len(self.tried_ms) > 1:
            tried = ", ".join(f"{ms:.0f} ms on {n}" for n, ms in sorted(self.tried_ms.items()))
            return f"{head} (the fastest step: {tried})"
        return head


def thread_candidates(cores: int) -> list[int]:
    """1, 2, 4, ... and the core count itself."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [max(1, cores)]


def fastest_threads(medians_ms: Mapping[int, float]) -> int:
    """The fewest threads whose step no larger count beats by MORE_THREADS_GAIN."""
    best = min(medians_ms)
    for count in sorted(medians_ms):
        if medians_ms[count] < MORE_THREADS_GAIN * medians_ms[best]:
            best = count
    return best


def choose_threads(step_ms_at: Callable[[int], float], candidates: list[int], *,
                   rounds: int = THREAD_ROUNDS, max_s: float = THREAD_TRIAL_MAX_S,
                   clock: Callable[[], float] = time.perf_counter) -> Threads:
    """Times `step_ms_at(threads)` (which sets the threads and returns one frame's ms) for
    each candidate in turn, `rounds` times over (fewer once `max_s` has gone) -> the
    fastest by the median of its rounds."""
    tried: dict[int, list[float]] = {n: [] for n in candidates}
    began = clock()
    for done in range(rounds):
        for count in candidates:
            tried[count].append(step_ms_at(count))
        if done and clock() - began > max_s:
            break
    medians = {n: StepTimes.of(times).p50_ms for n, times in tried.items()}
    return Threads(fastest_threads(medians), medians)


@dataclass(frozen=True)
class ThreadsMemory:
    """The thread count measured once per machine and kept in a small JSON file, so that
    reply, talk and serve all run on the same count from one run to the next: on a CPU the
    count can change how products round, and `reply --seed` must give the same bytes
    (resumed with --skip-existing, on Ray or here). Keyed by all the count depends on."""

    path: Path
    key: str

    @classmethod
    def of(cls, cache_dir: Path, device: str, dtype: str, quantize: str, model_shape: str,
           cores: int | None = None) -> ThreadsMemory:
        """`model_shape`: a digest of the model's dimensions."""
        key = (f"{device}/{dtype.removeprefix('torch.')}/{quantize}/model {model_shape}/"
               f"{cores or os.cpu_count() or 1} cores")
        return cls(Path(cache_dir) / THREADS_FILE, key)

    @classmethod
    def for_model(cls, cache_dir: Path, device: str, dtype: str, quantize: str,
                  lm_arch: Mapping, cores: int | None = None) -> ThreadsMemory:
        """The memory of a model by its LM's dimensions (a digest of them), so that a
        checkpoint and doctor --bench's random weights of the same shape share one entry."""
        import hashlib

        shape = hashlib.sha256(json.dumps(dict(lm_arch), sort_keys=True, default=str)
                               .encode()).hexdigest()[:12]
        return cls.of(cache_dir, device, dtype, quantize, shape, cores)

    @classmethod
    def of_model(cls, model, cores: int | None = None) -> ThreadsMemory:
        """Where the count for this model.Model's device, dtype, quantization, shape and the
        core count is remembered."""
        from ..model.files import tool_cache_dir

        return cls.for_model(tool_cache_dir(), model.device.type, str(model.dtype),
                             model.quantize, model.lm_arch, cores)

    @staticmethod
    def read_all(path: Path) -> dict[str, dict]:
        """Every remembered decision ({} when none, or the file is unreadable)."""
        try:
            entries = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}

    def recall(self) -> Threads | None:
        entry = self.read_all(self.path).get(self.key)
        try:
            tried = {int(n): float(ms) for n, ms in entry.get("tried_ms", {}).items()}
            return Threads(int(entry["count"]), tried, given="measured once on this machine")
        except (AttributeError, KeyError, TypeError, ValueError):
            return None

    def remember(self, threads: Threads) -> None:
        """Adds this decision to the file, written whole by a rename; a cache that cannot
        be written is only not remembered."""
        entries = self.read_all(self.path)
        entries[self.key] = {"count": threads.count,
                             "tried_ms": {str(n): round(ms, 2)
                                          for n, ms in threads.tried_ms.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
            os.replace(partial, self.path)
        except OSError:
            pass


def apply_remembered(memory: ThreadsMemory | None, device: str, *,
                     environ: Mapping[str, str] = os.environ,
                     set_threads: Callable[[int], None] | None = None) -> Threads:
    """For a command that does not measure (reply, doctor --bench): the remembered count,
    applied, unless OMP_NUM_THREADS decides or the device is not a CPU -> the count it
    runs on, and where that came from (for its -v line)."""
    import torch

    if device != "cpu":
        return Threads(torch.get_num_threads(), given="torch's default off the CPU")
    if environ.get(THREADS_VARIABLE, "").strip():
        return Threads(torch.get_num_threads(), given=f"{THREADS_VARIABLE} as set")
    threads = memory.recall() if memory is not None else None
    if threads is None:
        return Threads(torch.get_num_threads(), given="torch's default: not measured by "
                       "serve or talk on this machine yet")
    (set_threads or torch.set_num_threads)(threads.count)
    return threads


def decide_threads(step: Callable[[np.ndarray], object], device: str, batch: int = 1, *,
                   environ: Mapping[str, str] = os.environ, cores: int | None = None,
                   fixed: int | None = None, set_threads: Callable[[int], None] | None = None,
                   memory: ThreadsMemory | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> Threads:
    """Decides and applies torch's thread count by stepping `step` on silence (see the
    module's note), or takes what `memory` remembers for this machine (and remembers what
    it measured); `fixed` is a count a deployment already chose. On a GPU, torch's
    default stays: the host only launches work."""
    import torch

    set_threads = set_threads or torch.set_num_threads
    if fixed:
        set_threads(fixed)
        return Threads(fixed, given="the deployment's share of the cores")
    if device != "cpu":
        return Threads(torch.get_num_threads(), given="torch's default off the CPU")
    if environ.get(THREADS_VARIABLE, "").strip():
        return Threads(torch.get_num_threads(), given=f"{THREADS_VARIABLE} as set")
    candidates = thread_candidates(cores or os.cpu_count() or 1)
    if len(candidates) == 1:
        set_threads(1)
        return Threads(1, given="one core")
    remembered = memory.recall() if memory is not None else None
    if remembered is not None:
        set_threads(remembered.count)
        return remembered

    def step_ms_at(count: int) -> float:
        set_threads(count)
        return time_steps(step, batch, skipped=1, measured=THREAD_ROUND_FRAMES,
                          max_s=THREAD_TRIAL_MAX_S / 4, clock=clock).p50_ms

    threads = choose_threads(step_ms_at, candidates, clock=clock)
    set_threads(threads.count)
    if memory is not None:
        memory.remember(threads)
    return threads


# -- rows in real time ----------------------------------------------------------------------

def real_time_rows(step_ms: Mapping[int, float], budget_ms: float = STEP_BUDGET_MS,
                   buckets: tuple[int, ...] | None = None) -> int:
    """How many rows a step holds within its budget: the largest row count measured
    within it, or between the last within and the first over it, linearly. With CUDA
    graphs (`buckets`: the live counts captured), a step costs the smallest captured batch
    that covers its rows, so a cost holds up to its own count and no further."""
    within = [rows for rows, ms in step_ms.items() if ms <= budget_ms]
    if not within:
        return 0
    best = max(within)
    over = [rows for rows in step_ms if rows > best]
    if not over or buckets:
        return best
    nxt = min(over)
    a, b = step_ms[best], step_ms[nxt]
    return best + int((budget_ms - a) / (b - a) * (nxt - best)) if b > a else best


def sweep_rows(step_ms_at: Callable[[int], float], max_rows: int, *,
               max_s: float = SWEEP_MAX_S, budget_ms: float = STEP_BUDGET_MS,
               clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Median step ms at 1, 2, 4, ... live rows up to `max_rows`, until a step takes longer
    than its budget or `max_s` has gone."""
    measured: dict[int, float] = {}
    began, rows = clock(), 1
    while True:
        measured[rows] = step_ms_at(rows)
        if measured[rows] > budget_ms or rows >= max_rows or clock() - began > max_s:
            return measured
        rows = min(2 * rows, max_rows)


@dataclass(frozen=True)
class Capacity:
    """What the warm-up decided for a session of rows: threads, step time by live rows,
    and how many rows the session takes (the smaller of what fits in memory and what keeps
    real time, unless asked for)."""

    device: str
    threads: Threads
    step_ms: Mapping[int, float]  # live rows -> median ms per step
    fits_memory: int  # rows the memory holds (with the default's ceiling)
    asked: int | None = None  # --max-sessions
    prime_ms: float = 0.0  # per priming frame
    times: Mapping[int, StepTimes] = field(default_factory=dict)  # live rows -> the spread
    buckets: tuple[int, ...] | None = None  # the live counts CUDA graphs were captured at

    @property
    def real_time(self) -> int:
        return real_time_rows(self.step_ms, buckets=self.buckets)

    @property
    def rows(self) -> int:
        if self.asked is not None:
            return self.asked
        return max(1, min(self.fits_memory, self.real_time))

    @property
    def bound(self) -> str:
        """What set `rows`, in words for the start line."""
        if self.asked is not None:
            return "as --max-sessions asked"
        if self.real_time < 1:
            return "no caller keeps real time on this device; one slot"
        if self.fits_memory <= self.real_time:
            return "bound by memory; each of them keeps real time"
        return f"bound by real time; {self.fits_memory} would fit in memory"

    def warning(self) -> str | None:
        if self.asked is None or self.asked <= self.real_time:
            return None
        return (f"--max-sessions {self.asked} is over the {self.real_time} caller"
                f"{'' if self.real_time == 1 else 's'} this device steps in real time: with "
                "more live at once, every caller falls behind and loses audio")

    def line(self) -> str:
        measured = ", ".join(f"{ms:.0f} ms at {rows}" for rows, ms in sorted(self.step_ms.items()))
        n = self.real_time
        return (f"warm-up: {n} caller{'' if n == 1 else 's'} in real time on {self.device} "
                f"with {self.threads.text()}; one step for every live caller: {measured}")


def verdict(times: StepTimes, device: str, parameters: int,
            threads: Threads | None = None) -> str:
    """talk's line: what was measured and whether this device keeps up with one caller, by
    the one rule (`real_time_rows`). The hint that a GPU is needed is given for the
    full-size model on a CPU only."""
    on = device if threads is None else f"{device} with {threads.text()}"
    head = (f"warm-up: {times.p50_ms:.0f} ms per 80 ms frame on {on} (median of "
            f"{times.frames} frames, 8 in 10 within {times.p10_ms:.0f}-{times.p90_ms:.0f} ms;"
            f" real-time factor {times.rtf:.2f})")
    if real_time_rows({1: times.p50_ms}) >= 1:
        return f"{head}: keeps up"
    if times.rtf <= 1.0:
        return f"{head}: keeps up, barely; on a busy machine some caller audio may be dropped"
    why = ""
    if device == "cpu" and parameters >= FULL_SIZE_PARAMETERS:
        why = " (on a CPU the full-size model is far too slow; use a GPU)"
    return (f"{head}: this device cannot keep up with the model in real time{why}; caller "
            "audio will be dropped to keep latency bounded")


def settle(slots, prompt, sampling, frames: int = SKIPPED_FRAMES + MEASURED_FRAMES) -> None:
    """Steps fresh slots on one live row for `frames` frames, so that the first caller does
    not pay their one-off costs (in a call, a late frame is audio missed); the persona
    stays primed in the slots' cache."""
    slot = slots.join(prompt, sampling, 0)
    try:
        time_steps(slots.step, slots.capacity, skipped=0, measured=frames)
    finally:
        slots.leave(slot)


def warm_up_slots(slots, prompt, sampling, device: str, *, fits_memory: int,
                  asked: int | None = None, threads: int | None = None,
                  memory: ThreadsMemory | None = None, counts: Sequence[int] | None = None,
                  frames: int = SWEEP_FRAMES,
                  environ: Mapping[str, str] = os.environ, cores: int | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> Capacity:
    """Warms up a runtime Scheduler's slots as a server runs them: primes the persona into
    a row (timed), decides the threads on that live row, then steps 1, 2, 4, ... live rows
    (as many as `asked`, or as fit in memory; or exactly `counts`), `frames` counted at
    each -> the Capacity. Every row leaves afterwards; the persona stays primed in the
    slots' cache."""
    rows: list[int] = []
    times: dict[int, StepTimes] = {}
    try:
        began = clock()
        rows.append(slots.join(prompt, sampling, 0))
        prime_ms = 1000.0 * (clock() - began) / max(prompt.frames, 1)
        decided = decide_threads(slots.step, device, slots.capacity, environ=environ,
                                 cores=cores, fixed=threads, memory=memory,
                                 clock=clock)

        def step_ms_at(live: int) -> float:
            while len(rows) < live:
                rows.append(slots.join(prompt, sampling, len(rows)))
            times[live] = time_steps(slots.step, slots.capacity, skipped=SWEEP_SKIPPED,
                                     measured=frames, clock=clock)
            return times[live].p50_ms

        if counts is None:
            step_ms = sweep_rows(step_ms_at, min(slots.capacity, asked or fits_memory),
                                 clock=clock)
        else:
            step_ms = {live: step_ms_at(live) for live in counts}
    finally:
        for slot in rows:
            slots.leave(slot)
    # With graphs the sweep's counts (1, 2, 4 ...) are the captured ones: their costs.
    return Capacity(device, decided, step_ms, fits_memory, asked, prime_ms, times,
                    slots.step_buckets)


def warm_up_row(slots, prompt, sampling, seed, device: str, *,
                memory: ThreadsMemory | None = None, environ: Mapping[str, str] = os.environ,
                clock: Callable[[], float] = time.perf_counter) -> Capacity:
    """Warms up a one-row session as talk runs it: primes the persona into its row with
    its seed (timed), decides the threads on it, then times it on silence (SKIPPED_FRAMES
    first, then up to MEASURED_FRAMES) -> the Capacity of one row. The row leaves
    afterwards: the next with this persona starts from the cache, as if new."""
    began = clock()
    slot = slots.join(prompt, sampling, seed)
    try:
        prime_ms = 1000.0 * (clock() - began) / max(prompt.frames, 1)
        decided = decide_threads(slots.step, device, slots.capacity, environ=environ,
                                 memory=memory, clock=clock)
        times = time_steps(slots.step, slots.capacity, clock=clock)
    finally:
        slots.leave(slot)
    return Capacity(device, decided, {1: times.p50_ms}, 1, 1, prime_ms, {1: times},
                    slots.step_buckets)
