"""The one scheduler: it owns the session's rows from a row's admission to its last frame,
and is the only code that steps or primes the session.

Every command submits rows and reads what they produce; none steps the session itself:

    command        rows' source                         pacing   entry point
    serve          network callers (frames arrive),    TICK     `start`, `add`, `remove`
                   recordings (POST /api/reply)                   (its own thread)
    reply, Ray     recordings                          FREE     `answer(requests)`
    talk           a sound card or a recording at      SOURCE   `follow(row, read, hand_out)`
                   its clock's pace                               (the caller's thread)

One step, whatever the pacing: each row's source gives its next frame (`Row.take`); a
caller whose frame has not arrived is stepped on silence (counted late), a source that has
ended ends its row; one `Session.step` for the rows up to the last live one; the step's
time and row count go into the one `StepStats`. A newcomer takes the lowest free slot and
primes between steps (runtime/priming.py decides its turn); the pacing decides when and how
much.

Only numpy and the standard library at import: talk's loop and serve's calls name its
types without loading torch.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from ..core.config import FRAME_SECONDS, FRAME_SIZE, PERSONAS_CACHED
from ..errors import InputError, PersonaplexError
from ..live.jitter import CALLER_QUEUE_FRAMES
from .limits import role_prompt_refusal
from .rows import (Answered, Frame, RecordingRow, ReplyFrame, ReplyRequest, Row, RowState,
                   SourceRow)
from .stats import StepStats

TICK_S = FRAME_SECONDS
PRIME_MARGIN_S = 0.004  # of each tick's spare time left unprimed (a sleep wakes late)
COST_SMOOTHING = 0.25  # weight of the newest priming measurement
CATCH_UP_S = CALLER_QUEUE_FRAMES * TICK_S  # how far behind its ticks the engine catches up


class Pacing(enum.Enum):
    TICK = "tick"  # every 80 ms of the system clock, while a network caller is live
    SOURCE = "source"  # whenever the row's source has a frame (a sound card's clock)
    FREE = "free"  # as fast as the device steps (recordings)


class SlotsFull(PersonaplexError):
    """Every slot holds a row."""


@dataclass
class Callbacks:
    """How a TICK-paced scheduler reports, on its own thread. `frames(batch)`: one call per
    step with (row, pcm [1920], piece) of every live real-time row; `live(row)`: primed, its
    frames follow; `done(row)`: an offline row has its whole answer; `refused(row, error)`:
    the scheduler cannot take this row; `failed(error)`: the scheduler stopped on an error."""

    frames: Callable[[list], None]
    live: Callable[[Row], None]
    done: Callable[[Row], None]
    refused: Callable[[Row, Exception], None]
    failed: Callable[[BaseException], None]


class Scheduler:
    """`capacity` slots over one core.session.Session, primed through a runtime.priming
    .Priming, paced as its entry point says (see the module's note). One thread drives
    it; `add` and `remove` may be called from any thread while `start` runs it.

    `model` makes personas into tokens (prompts.persona.PersonaPrompt.persona_tokens) and
    rows' seeds into noise; `tokenizer` (the model's, None: no text) makes the pieces."""

    def __init__(self, model, session, priming, *, tokenizer=None,
                 callbacks: Callbacks | None = None, stats: StepStats | None = None,
                 prime_cost_s: float = 0.01):
        self.model = model
        self.session = session
        self.priming = priming
        self.tokenizer = tokenizer
        self.capacity = session.batch
        self.callbacks = callbacks
        self.stats = StepStats() if stats is None else stats
        self.stats.prime_cost_s = prime_cost_s
        self.measured_prime_cost_s: float | None = None  # the warm-up's, for --max-prime-s
        self.max_prime_s = 0.0  # the most priming a role prompt may take (0: no limit)
        self.warmup = None  # runtime.warmup.Capacity: what runtime.open decided
        self.graphs_fallback: str | None = None  # why graphs on auto were left for eager
        # Off, a step computes the rows up to the last live one; on, every row, so that a
        # row's products keep one shape whoever shares the batch (reply's same bytes).
        self.whole_batch = False
        self._slots: list[Row | None] = [None] * self.capacity
        self.seats = 0  # rows admitted, in a slot or on their way to one
        self._seats_lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._silence = np.zeros((self.capacity, FRAME_SIZE), np.float32)

    @classmethod
    def for_model(cls, model, capacity: int, *, graphs: bool | None = None,
                  cached_personas: int = PERSONAS_CACHED, **options) -> Scheduler:
        """`capacity` slots of `model` (a model.Model, loaded here), with CUDA graphs as
        `graphs` asks (None: wherever they can be captured; a failed capture then leaves
        the scheduler eager, and `graphs_fallback` says why)."""
        from ..core.config import primer_rows
        from ..core.graphs import graphed_or_eager, make_generator
        from ..core.priming import Primer
        from ..core.session import Session
        from .priming import Priming

        if capacity < 1:
            raise ValueError("a batch needs at least one row")
        rows = primer_rows(capacity)

        def build(graphed: bool) -> tuple[Session, Primer]:
            session = Session(model.mimi, model.lm, capacity, graphs=graphed)
            gen = (make_generator(model.lm, rows, graphs=graphed, pool=session.pool) if rows
                   else session.gen)  # a batch of one primes in its own row
            return session, Primer(gen)

        (session, primer), fallback = graphed_or_eager(build, next(model.lm.parameters()).device,
                                                      graphs)
        scheduler = cls(model, session, Priming(session, primer, cached_personas),
                        tokenizer=getattr(model, "tokenizer", None), **options)
        scheduler.graphs_fallback = fallback
        return scheduler

    @property
    def step_buckets(self) -> tuple[int, ...] | None:
        """The live counts CUDA graphs were captured at (a step costs the smallest that
        covers its rows), or None for eager steps, which cost their rows."""
        return self.session.buckets

    # -- admission (any thread) ----------------------------------------------------------------

    def admit(self) -> bool:
        """A seat for a row to come (a caller whose persona is still being prepared, a
        recording still arriving), if one is free: every admitted row finds a slot. Held
        until `release`."""
        with self._seats_lock:
            if self.seats >= self.capacity:
                return False
            self.seats += 1
            return True

    def release(self) -> None:
        with self._seats_lock:
            self.seats -= 1

    # -- the slots -----------------------------------------------------------------------------

    def live(self) -> list[int]:
        return [slot for slot, row in enumerate(self._slots)
                if row is not None and row.state is RowState.LIVE]

    def free(self) -> int:
        return self._slots.count(None)

    def attend_over_whole_windows(self) -> None:
        """Every step computes every row over its whole window, so a row's products keep
        one shape whoever shares the batch and however far it is (reply's same bytes)."""
        self.whole_batch = True
        self.session.attend_over_whole_windows()

    def begin(self, prompt, sampling=None, seed=None) -> int:
        """A slot for a new conversation of `prompt` (a prompts.persona.PersonaPrompt),
        sampling by `sampling` (None: the default) from `seed` (an int: the run repeats
        exactly, whoever shares the batch; None: fresh entropy; a saved generator state:
        the reference's own draws), its priming queued -> the slot. Raises SlotsFull, or
        InputError for sampling this session cannot do."""
        return self._begin(Row(prompt, sampling, seed))

    def _begin(self, row: Row) -> int:
        from ..core.sampling import Sampling

        if None not in self._slots:
            raise SlotsFull(f"all {self.capacity} rows hold a stream")
        sampling = Sampling() if row.sampling is None else row.sampling
        try:
            self.session.check_sampling(sampling)
        except ValueError as error:
            raise InputError(str(error)) from None
        slot = self._slots.index(None)
        self.priming.queue(slot, row.prompt.persona_tokens(self.model), sampling,
                           self._noise(row.seed), row.key)
        row.slot, row.state = slot, RowState.PRIMING
        self._slots[slot] = row
        return slot

    def _noise(self, seed):
        """A row's noise (core/sampling.py): a key for an int or None, a generator for a
        saved generator state."""
        import torch

        from ..core.sampling import make_rng, noise_key

        if not isinstance(seed, torch.Tensor):
            return noise_key(seed)
        rng = make_rng(self.session.device)
        rng.set_state(seed)
        return rng

    def pending_frames(self) -> int:
        """Priming frames still to run for the queued joins (each persona once)."""
        return self.priming.pending()

    @property
    def primer_steps(self) -> int:
        """Steps the primer has run, the measure of priming's device time."""
        return self.priming.steps

    def prime(self, max_frames: int) -> list[int]:
        """Starts the joins whose persona is cached, then runs up to `max_frames` steps of
        the primer (runtime/priming.py decides whose) -> the slots that went live."""
        went_live = self.priming.prime(max_frames)
        for slot in went_live:
            self._slots[slot].state = RowState.LIVE
        return went_live

    def join(self, prompt, sampling=None, seed=None) -> int:
        """A new conversation in a free slot, primed -> its slot."""
        slot = self.begin(prompt, sampling, seed)
        while slot not in self.live():
            self.prime(self.pending_frames())
        return slot

    def leave(self, slot: int) -> None:
        """Frees the slot at once (a queued join is dropped)."""
        row = self._slots[slot]
        self.priming.drop(slot)
        self.session.free(slot)
        self._slots[slot] = None
        if row is not None:
            row.state = RowState.ENDED

    def step(self, pcm: np.ndarray | None = None, *, agent=None, text=None) -> Frame:
        """pcm [capacity, 1920] float32, the callers (slots not live: any value; None: all
        silent) -> one Frame of `capacity` rows. A step costs the rows up to the last live
        one, not the capacity. `agent` [capacity, 8] and `text` [capacity] (tensors on the
        session's device) force the assistant's tokens (teacher forcing, doctor's
        agreement check); the session's `predicted` then holds the model's own."""
        import torch

        pcm = self._silence if pcm is None else np.ascontiguousarray(pcm, np.float32)
        live = self.live()
        rows = live[-1] + 1 if live and not self.whole_batch else self.capacity
        audio, tokens = self.session.step(torch.from_numpy(pcm), rows, agent=agent, text=text)
        tokens = tokens.numpy()
        pieces = [""] * self.capacity  # rows without a stream say nothing
        if self.tokenizer is not None:
            for slot in live:
                pieces[slot] = self.tokenizer.piece(tokens[slot, 0])
        return Frame(audio.numpy(), tokens, pieces)

    # -- the limit on priming ------------------------------------------------------------------

    def check_priming(self, prompt) -> None:
        """--max-prime-s: InputError, with the figure, for a persona whose role prompt needs
        more device time to prime than `max_prime_s`, at the warm-up's cost per priming
        frame, or one timed on a few primer steps of the first persona checked."""
        if self.max_prime_s <= 0:
            return
        cost_s = self.measured_prime_cost_s
        if cost_s is None and self.priming.in_place and self.free() < self.capacity:
            cost_s = self.stats.prime_cost_s  # its one row holds a stream: none to time in
        elif cost_s is None:
            cost_s = self.measured_prime_cost_s = self.priming.time_step(
                prompt.persona_tokens(self.model))
        refusal = role_prompt_refusal(len(prompt.text_tokens), cost_s, self.max_prime_s)
        if refusal is not None:
            raise InputError(refusal)

    # -- rows in and out ---------------------------------------------------------------------

    def _end(self, row: Row) -> None:
        if row.slot is not None and self._slots[row.slot] is row:
            self.leave(row.slot)
        row.state = RowState.ENDED

    def _prime(self, max_frames: int) -> list[Row]:
        """Up to `max_frames` steps of the primer -> the rows that went live."""
        before, steps_before = self.pending_frames(), self.primer_steps
        began = time.perf_counter()
        went_live = self.prime(max_frames)
        # A primer step moves every persona seated in it: its time is the cost to budget.
        steps = self.primer_steps - steps_before
        if steps > 0:
            cost = (time.perf_counter() - began) / steps
            self.stats.prime_cost_s += COST_SMOOTHING * (cost - self.stats.prime_cost_s)
        self.stats.primed_frames += max(0, before - self.pending_frames())
        return [self._slots[slot] for slot in went_live]

    def _join_now(self, row: Row) -> None:
        """`row` primed to the end before the next step (nobody waits for a tick)."""
        self._begin(row)
        while not row.live:
            self._prime(self.pending_frames())

    # -- one step, every pacing ----------------------------------------------------------------

    def _gather(self, rows: Iterable[Row], ended: list[tuple[Row, Exception | None]]
                ) -> list[tuple[Row, np.ndarray]]:
        """Each row's next frame: silence for a real-time caller whose frame is late; a row
        whose source ended (or failed reading: a PersonaplexError) leaves, into `ended`."""
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
                frame = self._silence[0]
            gathered.append((row, frame))
        return gathered

    def _step(self, gathered: list[tuple[Row, np.ndarray]]) -> Frame:
        """One step of the batch on the gathered frames (other slots: silence) -> its
        Frame; the time and the rows go into the statistics."""
        pcm = np.zeros((self.capacity, FRAME_SIZE), np.float32)
        for row, frame in gathered:
            pcm[row.slot] = frame
        began = time.perf_counter()
        out = self.step(pcm)
        self.stats.record_step(time.perf_counter() - began, len(gathered))
        for row, _ in gathered:
            row.frames += 1
        return out

    def _rows(self) -> list[Row]:
        return [row for row in self._slots if row is not None]

    # -- FREE: recordings answered with continuous batching (reply, the Ray workers) ---------

    def answer(self, requests: Iterable[ReplyRequest]) -> Iterator[Answered]:
        """Answers recordings with continuous batching: a row whose recording has ended
        takes the next request at once, so no reply waits for a longer one. Yields one
        `Answered` per step. Each reply is exactly as long as its input plus its tail and
        equals the same request answered alone. Requests are pulled lazily, when a slot is
        free."""
        from ..audio.frames import frames_with_tail

        pending = iter(requests)
        more = True
        while True:
            ended: list[tuple[Row, Exception | None]] = []
            gathered = self._gather(self._rows(), ended)
            while more and self.free():
                request = next(pending, None)
                if request is None:
                    more = False
                    break
                row = RecordingRow(request.prompt, request.sampling, request.seed,
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

    # -- SOURCE: one row at its source's pace (talk) -----------------------------------------

    def follow(self, row: SourceRow, read: Callable[[], np.ndarray | None],
               hand_out: Callable[[Frame], None]) -> None:
        """Admits `row`, primes it, then steps it whenever `read()` gives its next frame
        (`read` waits for it), until the source ends (None) or fails (its PersonaplexError
        is raised here); `hand_out(frame)` gets every step's Frame. The row leaves at the
        end."""
        row.read = read
        self._join_now(row)
        try:
            while True:
                ended: list[tuple[Row, Exception | None]] = []
                gathered = self._gather([row], ended)
                for _, error in ended:  # a source that fails ends the session with its error
                    if error is not None:
                        raise error
                if not gathered:
                    return
                hand_out(self._step(gathered))
        finally:
            self._end(row)

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
        as fast as the device steps. With nobody live, priming runs a tick's worth at a
        time all the same, so that the commands are read between two: a newcomer whose
        persona is cached goes live at once, whatever long prompt is priming."""
        next_tick = None
        while not self._stopping:
            rows = self._rows()
            self._handle_commands(block=not rows)
            live = [row for row in self._rows() if row.live]
            if not live:
                next_tick = None
                if self.pending_frames():
                    self._went_live(self._prime(self._tick_of_priming()))
                continue
            self._tick(live)
            if not any(row.realtime for row in live):
                next_tick = None
                if self.pending_frames():
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
            if self.pending_frames():
                self._went_live(self._prime(self._tick_of_priming(next_tick - now)))
            delay = next_tick - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    def _tick_of_priming(self, spare_s: float = TICK_S) -> int:
        """Priming frames that fit in `spare_s` at the measured cost, and at least one (so
        that a newcomer gets through on a device with no time to spare)."""
        return max(1, int((spare_s - PRIME_MARGIN_S) / max(self.stats.prime_cost_s, 1e-6)))

    def _went_live(self, rows: list[Row]) -> None:
        for row in rows:
            self.callbacks.live(row)

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

