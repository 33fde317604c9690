"""The one scheduler: it owns a `ConversationBatch` and is the only code that steps it.

Every command submits rows and reads what they produce; none steps the engine itself:

    command        rows' source                         pacing   entry point
    serve          network callers (frames arrive),    TICK     `start`, `add`, `remove`
                   recordings (POST /api/reply)                   (its own thread)
    reply, Ray     recordings                          FREE     `answer(requests)`
    talk           a sound card or a recording at      SOURCE   `follow(row, hand_out)`
                   its clock's pace (live/loop.py)               (the caller's thread)

One step, whatever the pacing: each row's source gives its next frame (`Row.take`); a
caller whose frame has not arrived is stepped on silence (counted late), a source that has
ended ends its row; one `step` for all rows; the step's time and row count go into the one
`StepStats`. Priming of newcomers (`begin`, then `prime` between steps) is asked of the
ConversationBatch, whose methods decide how; the scheduler decides only when and how much.

Only numpy and the standard library at import: talk's loop uses it without torch here.
"""

from __future__ import annotations

import collections
import enum
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator

import numpy as np

from ..core.config import ASSISTANT_CODES, FRAME_SECONDS, FRAME_SIZE
from .limits import CALLER_QUEUE_FRAMES
from .stats import StepStats

TICK_S = FRAME_SECONDS
PRIME_MARGIN_S = 0.004  # of each tick's spare time left unprimed (a sleep wakes late)
# After a stall the queue would stay as deep as the stall left it (a frame comes and goes
# each tick), and the caller's latency with it: a queue deeper than this for this many
# ticks in a row loses its oldest frame.
INPUT_TARGET_FRAMES = 2
INPUT_SHRINK_TICKS = 25  # 2 s
COST_SMOOTHING = 0.25  # weight of the newest priming measurement
CATCH_UP_S = CALLER_QUEUE_FRAMES * TICK_S  # how far behind its ticks the engine catches up


class Pacing(enum.Enum):
    TICK = "tick"  # every 80 ms of the system clock, while a network caller is live
    SOURCE = "source"  # whenever the row's source has a frame (a sound card's clock)
    FREE = "free"  # as fast as the device steps (recordings)


class RowState(enum.Enum):
    WAITING = "waiting"  # submitted, no slot yet
    PRIMING = "priming"  # in a slot, its persona being primed
    LIVE = "live"  # stepped with the others
    ENDED = "ended"  # its source ended, it left, or it was refused


# -- rows -----------------------------------------------------------------------------------

class Row:
    """One conversation on the scheduler: what it is (persona prompt, sampling, seed), where
    it is (slot, state) and what it did (frames, late). The scheduler's thread sets `slot`
    and `state` and calls `take`; anyone may read the counters. `owner` is the submitter's
    own business (serve's Call, a reply's future, a manifest row's key).

    `realtime`: frames arrive on their own (a network caller), so a missing frame is
    stepped as silence; otherwise a missing frame means the source has ended."""

    realtime = False

    def __init__(self, prompt, sampling, seed):
        self.prompt = prompt
        self.sampling = sampling
        self.seed = seed
        self.owner: Any = None
        self.slot: int | None = None
        self.state = RowState.WAITING
        self.frames = 0  # steps this row took part in
        self.late = 0  # ticks that found no caller frame waiting (silence was stepped)

    @property
    def key(self) -> Hashable | None:
        """The persona's key in the engine's cache of primed personas."""
        return getattr(self.prompt, "key", None)

    @property
    def live(self) -> bool:
        return self.state is RowState.LIVE

    def take(self) -> np.ndarray | None:
        """The row's next caller frame [1920] float32 (None: none now, or the end)."""
        raise NotImplementedError


class LiveRow(Row):
    """A network caller: frames arrive from the asyncio thread into a bounded queue; when
    it is full the oldest frame goes (counted), so latency stays bounded."""

    realtime = True

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


class RecordingRow(Row):
    """A recording answered in a slot: `frames` yields (frame, samples of the answer to
    keep) as audio.frames.frames_with_tail does. `keep` is the current frame's."""

    def __init__(self, prompt, sampling, seed, frames: Iterator[tuple[np.ndarray, int]]):
        super().__init__(prompt, sampling, seed)
        self._frames = frames
        self.keep = FRAME_SIZE
        self.index = 0  # the answer's frames handed out

    def take(self) -> np.ndarray | None:
        item = next(self._frames, None)
        if item is None:
            return None
        frame, self.keep = item
        return frame


class OfflineRow(RecordingRow):
    """A recording whose answer collects in the row (serve's POST /api/reply)."""

    def __init__(self, prompt, sampling, seed: int | None,
                 frames: Iterator[tuple[np.ndarray, int]]):
        super().__init__(prompt, sampling, seed, frames)
        self.pcm: list[np.ndarray] = []
        self.tokens: list[np.ndarray] = []
        self.pieces: list[str] = []

    def collect(self, pcm: np.ndarray, tokens: np.ndarray, piece: str) -> None:
        self.pcm.append(pcm[:self.keep].copy())
        self.tokens.append(tokens.copy())
        self.pieces.append(piece)


# -- reply's rows ---------------------------------------------------------------------------

@dataclass
class ReplyFrame:
    """One frame of one stream's reply: the assistant's audio (trimmed on the stream's last
    frame), the frame's 17 tokens and its text piece."""

    index: int
    pcm: np.ndarray
    tokens: np.ndarray  # [17]: text, the assistant's codes 1..8, the caller's 9..16
    piece: str

    @property
    def codes(self) -> np.ndarray:
        """The assistant's Mimi codes [8]."""
        return self.tokens[ASSISTANT_CODES]


@dataclass
class ReplyRequest:
    """One recording to answer: `key` names it in what `Scheduler.answer` yields."""

    key: Hashable
    frames: Iterable[np.ndarray]  # its model frames (an InputFrames)
    prompt: Any  # conversation.PersonaPrompt
    sampling: Any = None  # core.sampling.Sampling (None: the default)
    seed: Any = None  # conversation.Seed
    tail_samples: int = 0


@dataclass
class Answered:
    """What one FREE step made: [(key, ReplyFrame)] for every row stepped, the keys whose
    replies are now complete, and [(key, error)] for recordings that could not be read to
    their end (the others go on)."""

    made: list[tuple[Hashable, ReplyFrame]] = field(default_factory=list)
    finished: list[Hashable] = field(default_factory=list)
    failed: list[tuple[Hashable, Exception]] = field(default_factory=list)

    def __iter__(self):  # made, finished, failed = answered
        return iter((self.made, self.finished, self.failed))


def longest_first(items: Iterable, length: Callable[[Any], int | None]) -> list:
    """The order in which continuous batching takes work of known lengths: the longest
    first (unknown lengths, None, before all), so that the batch ends on short replies and
    its rows stay busy to the end (bench/reply.py's 32 recordings of 2 to 30 s on 8 rows:
    803 steps for 802 steps' work, against 903 to 1013 in shuffled orders). Ties keep their
    order."""
    def key(item) -> float:
        frames = length(item)
        return -math.inf if frames is None else -frames

    return sorted(items, key=key)


# -- streams in lockstep (talk) -------------------------------------------------------------

class Conversation:
    """B streams sharing one persona, started together: talk's batch, which `Scheduler.follow`
    steps. `start(seeds)` primes them (again: a new conversation reuses the rows, their graphs
    and the primed persona); `step` takes one frame of each."""

    def __init__(self, model, prompt, sampling=None, *, batch: int = 1,
                 graphs: bool | None = None):
        from ..conversation import ConversationBatch
        from ..core.sampling import Sampling

        self.model = model
        self.prompt = prompt
        self.sampling = Sampling() if sampling is None else sampling
        self.batch = batch
        self.capacity = batch
        self.slots = ConversationBatch(model, batch, graphs=graphs)

    def start(self, seeds) -> None:
        """Primes every stream; stream b draws from its own generator seeded with seeds[b]
        (None: fresh entropy; a tensor: a saved generator state to resume), so what it says
        never depends on its batch mates."""
        if len(seeds) != self.batch:
            raise ValueError(f"{len(seeds)} seeds for {self.batch} streams")
        for slot in self.slots.live():
            self.slots.leave(slot)
        for seed in seeds:
            self.slots.join(self.prompt, self.sampling, seed)

    def step(self, pcm: np.ndarray):
        """pcm [B, 1920] float32, the caller -> the assistant's conversation.Frame."""
        return self.slots.step(pcm)


# -- serve's report -------------------------------------------------------------------------

@dataclass
class Callbacks:
    """How a TICK-paced scheduler reports, on its own thread. `frames(batch)`: one call per
    step with (row, pcm [1920], piece) of every live real-time row; `live(row)`: primed, its
    frames follow; `done(row)`: an offline row has its whole answer; `refused(row, error)`:
    the engine cannot take this row; `failed(error)`: the scheduler stopped on an error."""

    frames: Callable[[list], None]
    live: Callable[[Row], None]
    done: Callable[[Row], None]
    refused: Callable[[Row, Exception], None]
    failed: Callable[[BaseException], None]


# -- the scheduler --------------------------------------------------------------------------

class Scheduler:
    """Owns `slots` (a conversation.ConversationBatch, or for talk any batch-1 stepper:
    `step(pcm [capacity, 1920])` -> an object with .pcm, .tokens, .pieces) and steps its
    rows, paced as its entry point says (see the module's note). One thread drives it;
    `add` and `remove` may be called from any thread while `start` runs it."""

    def __init__(self, slots, callbacks: Callbacks | None = None,
                 prime_cost_s: float = 0.01, stats: StepStats | None = None):
        self.slots = slots
        self.capacity = getattr(slots, "capacity", 1)
        self.callbacks = callbacks
        self.stats = StepStats() if stats is None else stats  # a reader may hand its own
        self.stats.prime_cost_s = prime_cost_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._rows: dict[int, Row] = {}  # slot -> row, priming or live
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._silence = np.zeros(FRAME_SIZE, np.float32)

    # -- rows in and out --------------------------------------------------------------------

    def _begin(self, row: Row) -> None:
        """A slot for `row`, its priming queued. Raises what ConversationBatch.begin does."""
        row.slot = self.slots.begin(row.prompt, row.sampling, row.seed)
        row.state = RowState.PRIMING
        self._rows[row.slot] = row

    def _end(self, row: Row) -> None:
        if row.slot is not None and self._rows.get(row.slot) is row:
            self.slots.leave(row.slot)
            del self._rows[row.slot]
        row.state = RowState.ENDED

    def _prime(self, max_frames: int) -> list[Row]:
        """Up to `max_frames` steps of the primer -> the rows that went live."""
        before, steps_before = self.slots.pending_frames(), self.slots.primer_steps
        began = time.perf_counter()
        went_live = self.slots.prime(max_frames)
        # A primer step moves every persona seated in it: its time is the cost to budget.
        steps = self.slots.primer_steps - steps_before
        if steps > 0:
            cost = (time.perf_counter() - began) / steps
            self.stats.prime_cost_s += COST_SMOOTHING * (cost - self.stats.prime_cost_s)
        self.stats.primed_frames += max(0, before - self.slots.pending_frames())
        rows = []
        for slot in went_live:
            row = self._rows.get(slot)
            if row is not None:
                row.state = RowState.LIVE
                rows.append(row)
        return rows

    def _join_now(self, row: Row) -> None:
        """`row` primed to the end before the next step (FREE pacing: nobody waits)."""
        self._begin(row)
        while not row.live:
            self._prime(self.slots.pending_frames())

    # -- one step, every pacing -------------------------------------------------------------

    def _gather(self, rows: Iterable[Row], ended: list[tuple[Row, Exception | None]]
                ) -> list[tuple[Row, np.ndarray]]:
        """Each row's next frame: silence for a real-time caller whose frame is late; a row
        whose source ended (or failed reading: a PersonaplexError) leaves, into `ended`."""
        from ..errors import PersonaplexError

        gathered = []
        for row in rows:
            try:
                frame = row.take()
            except PersonaplexError as error:
                self._end(row)
                ended.append((row, error))
                continue
            if frame is None:
                if not row.realtime:
                    self._end(row)
                    ended.append((row, None))
                    continue
                if row.started:
                    row.late += 1
                    self.stats.late += 1
                frame = self._silence
            gathered.append((row, frame))
        return gathered

    def _step(self, gathered: list[tuple[Row, np.ndarray]]):
        """One step of the batch on the gathered frames (other slots: silence) -> its
        Frame; the time and the rows go into the statistics."""
        pcm = np.zeros((self.capacity, FRAME_SIZE), np.float32)
        for row, frame in gathered:
            pcm[row.slot] = frame
        began = time.perf_counter()
        out = self.slots.step(pcm)
        self.stats.record_step(time.perf_counter() - began, len(gathered))
        for row, _ in gathered:
            row.frames += 1
        return out

    # -- FREE: recordings answered with continuous batching (reply, the Ray workers) ---------

    def answer(self, requests: Iterable[ReplyRequest]) -> Iterator[Answered]:
        """Answers recordings with continuous batching: a row whose recording has ended
        takes the next request at once, so no reply waits for a longer one. Yields one
        `Answered` per step. Each reply is exactly as long as its input plus its tail and
        equals the same request answered alone. Requests are pulled lazily, when a row is
        free."""
        from ..audio.frames import frames_with_tail

        pending = iter(requests)
        more = True
        while True:
            ended: list[tuple[Row, Exception | None]] = []
            gathered = self._gather(list(self._rows.values()), ended)
            while more and self.slots.free():
                request = next(pending, None)
                if request is None:
                    more = False
                    break
                sampling = request.sampling
                if sampling is None:
                    from ..core.sampling import Sampling

                    sampling = Sampling()
                row = RecordingRow(request.prompt, sampling, request.seed,
                                   frames_with_tail(request.frames, request.tail_samples))
                row.owner = request.key
                self._join_now(row)
                gathered += self._gather([row], ended)
            answered = Answered(finished=[row.owner for row, error in ended if error is None],
                                failed=[(row.owner, error) for row, error in ended
                                        if error is not None])
            if not gathered:
                if answered.finished or answered.failed:
                    yield answered
                return
            out = self._step(gathered)
            for row, _ in gathered:
                answered.made.append((row.owner, ReplyFrame(
                    row.index, out.pcm[row.slot, :row.keep], out.tokens[row.slot],
                    out.pieces[row.slot])))
                row.index += 1
            yield answered

    # -- SOURCE: one row at its source's pace (talk) ----------------------------------------

    def follow(self, row: Row, hand_out: Callable[[Row, Any], None]) -> None:
        """Steps `row`, already primed in slot 0 of a batch-1 stepper, whenever its source
        gives a frame (`take` waits for it), until the source ends (`take` -> None) or
        fails (its PersonaplexError is raised here); `hand_out(row, frame)` gets every
        step's Frame."""
        row.slot = 0 if row.slot is None else row.slot
        row.state = RowState.LIVE
        while True:
            ended: list[tuple[Row, Exception | None]] = []
            gathered = self._gather([row], ended)
            for _, error in ended:  # a source that fails ends the session with its error
                if error is not None:
                    raise error
            if not gathered:
                return
            hand_out(row, self._step(gathered))

    # -- TICK: network callers and recordings on the scheduler's thread (serve) -------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def add(self, row: Row) -> None:
        self._commands.put(("add", row))

    def remove(self, row: Row) -> None:
        self._commands.put(("remove", row))

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - reported to the server, which ends
            self.callbacks.failed(error)

    def _loop(self) -> None:
        """Each tick: every live row's next frame (silence for a late caller), one step,
        the frames handed out in one batch; then newcomers primed in the time the tick has
        left, at the measured cost per priming frame, and a sleep to the next tick. At worst
        one priming frame per tick runs over, so a newcomer gets through on a device with
        no time to spare; ticks a slow step cost are caught up as far as the callers'
        queues reach. With no real-time caller live, nobody waits for ticks: recordings run
        as fast as the device steps."""
        next_tick = None
        while not self._stopping:
            self._handle_commands(block=not self._rows)
            live = [row for row in self._rows.values() if row.live]
            if not live:
                next_tick = None
                if self.slots.pending_frames():  # nobody waits for a tick: prime it all
                    self._went_live(self._prime(self.slots.pending_frames()))
                continue
            self._tick(live)
            if not any(row.realtime for row in live):
                next_tick = None
                if self.slots.pending_frames():
                    self._went_live(self._prime(1))
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
                self._went_live(self._prime(
                    max(1, int(spare / max(self.stats.prime_cost_s, 1e-6)))))
            delay = next_tick - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    def _went_live(self, rows: list[Row]) -> None:
        for row in rows:
            self.callbacks.live(row)

    def _handle_commands(self, block: bool) -> None:
        from ..errors import PersonaplexError

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
                try:
                    self._begin(row)
                except PersonaplexError as error:  # SlotsFull, or sampling it cannot take
                    row.state = RowState.ENDED
                    self.callbacks.refused(row, error)
            elif command == "remove":
                self._end(row)

    def _tick(self, live: list[Row]) -> None:
        ended: list[tuple[Row, Exception | None]] = []
        gathered = self._gather(live, ended)
        for row, error in ended:  # a recording's end: its answer is whole
            if error is None:
                self.callbacks.done(row)
            else:
                self.callbacks.refused(row, error)
        if not gathered:
            return
        out = self._step(gathered)
        batch = []
        for row, _ in gathered:
            if row.realtime:
                batch.append((row, out.pcm[row.slot].copy(), out.pieces[row.slot]))
            else:
                row.collect(out.pcm[row.slot], out.tokens[row.slot], out.pieces[row.slot])
        if batch:
            self.callbacks.frames(batch)
