"""The engine thread: it owns the `ConversationBatch` and steps every live row, every 80 ms.

Each tick it takes every live row's next caller frame (a real-time caller whose frame has
not arrived gets silence for that tick, counted as late), steps once for all rows, and
hands the frames out in one batch, without waiting for anyone to take them. Then it primes
newcomers (`slots.prime`) in the time the tick has left, at the priming cost per frame it
has measured, and sleeps to the next tick. So a slow caller, or a newcomer, never delays
the others: at worst one priming frame per tick runs over the budget, so that a newcomer
gets through on a device with no time to spare. Ticks a slow step cost are caught up, step
after step, as far as the callers' input queues reach.

Offline rows (`POST /api/reply`) take their frames from a recording. With no real-time
caller live, the engine does not wait for ticks: offline rows then run as fast as the
device steps.

Nothing here knows asyncio or the web: the server gives the engine callbacks, which it
calls on this thread.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ..core.config import FRAME_SECONDS, FRAME_SIZE
from ..runtime.limits import CALLER_QUEUE_FRAMES
from ..runtime.warmup import percentile_ms

TICK_S = FRAME_SECONDS
PRIME_MARGIN_S = 0.004  # of each tick's spare time left unprimed (a sleep wakes late)
STEP_TIMES_KEPT = 2048  # steps behind the p50/p99 figures
# After a stall the queue would stay as deep as the stall left it (a frame comes and goes
# each tick), and the caller's latency with it: a queue deeper than this for this many
# ticks in a row loses its oldest frame.
INPUT_TARGET_FRAMES = 2
INPUT_SHRINK_TICKS = 25  # 2 s
COST_SMOOTHING = 0.25  # weight of the newest priming measurement
CATCH_UP_S = CALLER_QUEUE_FRAMES * TICK_S  # how far behind its ticks the engine catches up


class Row:
    """One conversation on the engine. The engine thread sets `slot` and `live` and calls
    `take` each tick; the server reads the counters."""

    realtime = True

    def __init__(self, prompt, sampling, seed: int | None):
        self.prompt = prompt
        self.sampling = sampling
        self.seed = seed
        self.owner = None  # the session or request this row serves (the server's business)
        self.slot: int | None = None
        self.live = False
        self.frames = 0  # steps this row took part in
        self.late = 0  # ticks that found no caller frame waiting (silence was stepped)

    def take(self) -> np.ndarray | None:
        raise NotImplementedError


class LiveRow(Row):
    """A real-time caller: frames arrive from the asyncio thread into a bounded queue; when
    it is full the oldest frame goes (counted), so latency stays bounded."""

    def __init__(self, prompt, sampling, seed: int | None,
                 capacity: int = CALLER_QUEUE_FRAMES):
        super().__init__(prompt, sampling, seed)
        self._frames: collections.deque[np.ndarray] = collections.deque()
        self._lock = threading.Lock()
        self.capacity = capacity
        self.dropped_in = 0
        self.started = False  # a first frame has come: from then on, a missing one is late
        self._deep_ticks = 0

    def put(self, frame: np.ndarray) -> None:
        with self._lock:
            if len(self._frames) >= self.capacity:
                self._frames.popleft()
                self.dropped_in += 1
            self._frames.append(frame)
            self.started = True

    def take(self) -> np.ndarray | None:
        with self._lock:
            self._deep_ticks = self._deep_ticks + 1 if len(self._frames) > INPUT_TARGET_FRAMES \
                else 0
            if self._deep_ticks >= INPUT_SHRINK_TICKS:
                self._frames.popleft()
                self.dropped_in += 1
                self._deep_ticks = 0
            return self._frames.popleft() if self._frames else None

    @property
    def waiting(self) -> int:
        return len(self._frames)


class OfflineRow(Row):
    """A recording answered in a slot: `frames` yields (frame, samples of the answer to
    keep) as audio.frames.frames_with_tail does; the answer collects here."""

    realtime = False

    def __init__(self, prompt, sampling, seed: int | None,
                 frames: Iterator[tuple[np.ndarray, int]]):
        super().__init__(prompt, sampling, seed)
        self._frames = frames
        self._keep: collections.deque[int] = collections.deque()
        self.pcm: list[np.ndarray] = []
        self.tokens: list[np.ndarray] = []
        self.pieces: list[str] = []

    def take(self) -> np.ndarray | None:
        item = next(self._frames, None)
        if item is None:
            return None
        frame, keep = item
        self._keep.append(keep)
        return frame

    def collect(self, pcm: np.ndarray, tokens: np.ndarray, piece: str) -> None:
        self.pcm.append(pcm[:self._keep.popleft()].copy())
        self.tokens.append(tokens.copy())
        self.pieces.append(piece)


@dataclass
class EngineStats:
    """Figures the engine keeps (read from other threads: plain numbers, one writer)."""

    steps: int = 0
    frames: int = 0  # row-frames stepped: a step of B live rows counts B
    late: int = 0  # row-frames stepped on silence because the caller's frame was late
    overruns: int = 0  # ticks that ended after the next one was due
    primed_frames: int = 0
    prime_cost_s: float = 0.0  # measured seconds per primer step
    step_times: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=STEP_TIMES_KEPT))

    def step_ms(self, quantile: float) -> float | None:
        """The steps' ms at `quantile`, by the warm-up's measure (runtime.warmup)."""
        return percentile_ms([1000.0 * t for t in self.step_times], quantile)

    @property
    def real_time_factor(self) -> float | None:
        p50 = self.step_ms(0.5)
        return None if p50 is None else p50 / (1000.0 * TICK_S)


@dataclass
class Callbacks:
    """How the engine reports, on its own thread. `frames(batch)`: one call per step with
    (row, pcm [1920], piece) of every live real-time row; `live(row)`: primed, its frames
    follow; `done(row)`: an offline row has its whole answer; `refused(row, error)`: the
    engine cannot take this row; `failed(error)`: the engine stopped on an error."""

    frames: Callable[[list], None]
    live: Callable[[Row], None]
    done: Callable[[Row], None]
    refused: Callable[[Row, Exception], None]
    failed: Callable[[BaseException], None]


class Scheduler:
    """Runs `slots` on its own thread; `add(row)` and `remove(row)` from any thread."""

    def __init__(self, slots, callbacks: Callbacks, prime_cost_s: float = 0.01):
        self.slots = slots
        self.callbacks = callbacks
        self.stats = EngineStats(prime_cost_s=prime_cost_s)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._rows: dict[int, Row] = {}  # slot -> row, joining or live
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._silence = np.zeros(FRAME_SIZE, np.float32)

    def start(self) -> None:
        self._thread.start()

    def add(self, row: Row) -> None:
        self._commands.put(("add", row))

    def remove(self, row: Row) -> None:
        self._commands.put(("remove", row))

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - reported to the server, which ends
            self.callbacks.failed(error)

    def _loop(self) -> None:
        next_tick = None
        while not self._stopping:
            idle = not self._rows
            self._handle_commands(block=idle)
            live = [row for row in self._rows.values() if row.live]
            if not live:
                next_tick = None
                if self.slots.pending_frames():  # nobody waits for a tick: prime it all
                    self._prime(self.slots.pending_frames())
                continue
            self._step(live)
            if not any(row.realtime for row in live):
                next_tick = None
                if self.slots.pending_frames():
                    self._prime(1)
                continue
            now = time.perf_counter()
            next_tick = (now if next_tick is None else next_tick) + TICK_S
            if now > next_tick:  # the step ran over: the next ones follow at once
                self.stats.overruns += 1
                # A caller's client plays each tick lost as silence for good, so the ticks
                # a stall cost are caught up with the frames the callers' queues hold;
                # beyond that, the schedule starts again from now.
                if now > next_tick + CATCH_UP_S:
                    next_tick = now
            if self.slots.pending_frames():
                spare = next_tick - now - PRIME_MARGIN_S
                self._prime(max(1, int(spare / max(self.stats.prime_cost_s, 1e-6))))
            delay = next_tick - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    def _handle_commands(self, block: bool) -> None:
        while True:
            try:
                command, row = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                return
            block = False
            if command == "stop":
                self._stopping = True
                return
            if command == "add":
                self._begin(row)
            elif command == "remove" and row.slot is not None and \
                    self._rows.get(row.slot) is row:
                self.slots.leave(row.slot)
                del self._rows[row.slot]
                row.live = False

    def _begin(self, row: Row) -> None:
        from ..errors import PersonaplexError

        try:
            slot = self.slots.begin(row.prompt, row.sampling, row.seed)
        except PersonaplexError as error:  # SlotsFull, or sampling the engine cannot take
            self.callbacks.refused(row, error)
            return
        row.slot = slot
        self._rows[slot] = row

    def _prime(self, max_frames: int) -> None:
        before, steps_before = self.slots.pending_frames(), self.slots.primer_steps
        began = time.perf_counter()
        went_live = self.slots.prime(max_frames)
        # A primer step moves every persona seated in it: its time is the cost to budget.
        steps = self.slots.primer_steps - steps_before
        if steps > 0:
            cost = (time.perf_counter() - began) / steps
            self.stats.prime_cost_s += COST_SMOOTHING * (cost - self.stats.prime_cost_s)
        self.stats.primed_frames += max(0, before - self.slots.pending_frames())
        for slot in went_live:
            row = self._rows.get(slot)
            if row is not None:
                row.live = True
                self.callbacks.live(row)

    def _step(self, live: list[Row]) -> None:
        pcm = np.zeros((self.slots.capacity, FRAME_SIZE), np.float32)
        stepped = []
        for row in live:
            frame = row.take()
            if frame is None:
                if not row.realtime:  # its recording has ended: the answer is whole
                    self.slots.leave(row.slot)
                    del self._rows[row.slot]
                    row.live = False
                    self.callbacks.done(row)
                    continue
                if row.started:
                    row.late += 1
                    self.stats.late += 1
                frame = self._silence
            pcm[row.slot] = frame
            stepped.append(row)
        if not stepped:
            return
        began = time.perf_counter()
        out = self.slots.step(pcm)
        self.stats.step_times.append(time.perf_counter() - began)
        self.stats.steps += 1
        self.stats.frames += len(stepped)
        batch = []
        for row in stepped:
            row.frames += 1
            if row.realtime:
                batch.append((row, out.pcm[row.slot].copy(), out.pieces[row.slot]))
            else:
                row.collect(out.pcm[row.slot], out.tokens[row.slot], out.pieces[row.slot])
        if batch:
            self.callbacks.frames(batch)
