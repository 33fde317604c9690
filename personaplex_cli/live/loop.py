"""The live conversation engine: caller frames in, one model step each, assistant frames out.

Threads (`talk` wires them; nothing here draws or prints):

- PortAudio's callback thread (devices.DuplexStream): copies the microphone block into the
  bounded InputQueue and the next speaker block out of the OutputJitterBuffer; nothing else.
- The engine thread (`LiveLoop`): the scheduler it is given (runtime's, `follow`, paced by
  the source) runs talk's row on it: admitted and primed like any row, then per frame
  `source.read()` (waits for the next caller frame; for the microphone it also cancels the
  speaker's echo, so what the model hears is the cleaned signal), one step (timed in the
  runtime's StepStats), then `sink.write()` (the speaker or a file) and `record()`. It
  leaves the text pieces in `LiveLoop.pieces` for the main thread. An exception ends it and
  waits in `LiveLoop.error` for the main thread to re-raise.
- The main thread (cli/talk.py): prints the pieces, draws the view, writes the stats,
  watches the clock and Ctrl-C, and shuts everything down.

Sources of caller frames (`read() -> CallerFrame | None`, None at the end):

- `DeviceMic`: the stream's microphone, echo-cancelled, resampled to 24 kHz if needed;
- `RecordingCaller`: a recording instead of the microphone, at the pace of a clock:
  `DeviceClock` (the sound card's, when the assistant plays on the speaker), `PacedClock`
  (the system clock, when no device is open) or `FreeClock` (no pacing: benchmarks).

Latency stays bounded when the engine is slower than real time: at most `max_pending`
complete frames wait in the callers' one drop-oldest queue (jitter.InputQueue: the
device's, or `PacedClock`'s for a recording; serve's callers wait in one too); older ones
are dropped, counted and never heard, and the model goes on with the newest.

Alignment: the engine makes one step per caller frame it hears and records both with the
same index, so frame t of a recording's two channels is the caller frame of step t and the
assistant frame that step returned. Dropped frames are not in the recording (the model never
heard them), so the recorded assistant is `reply` on the recorded caller, frame for frame.

Only numpy and the standard library are imported here, and nothing of the runtime (it
stands above live/): the scheduler and the row come from the caller.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from ..audio.level import SILENCE_DBFS, dbfs
from ..core.config import FRAME_SECONDS, FRAME_SIZE
from ..histogram import Histogram
from ..errors import EngineStalled
from .jitter import CALLER_QUEUE_FRAMES, InputQueue

SECOND_FRAMES = round(1 / FRAME_SECONDS)


@dataclass
class CallerFrame:
    pcm: np.ndarray  # [1920] float32 at 24 kHz: what the model hears
    index: int  # place on the session's 80 ms timeline (gaps: dropped frames)
    delay_ms: float  # how long it waited between its capture and its processing
    keep: int = FRAME_SIZE  # how much of the answer to keep (less on a recording's last frame)


# -- caller sources -------------------------------------------------------------------------

class CallerSource:
    """Base of the sources: what the engine and the view may ask of any of them."""

    dropped = 0  # caller frames dropped because the engine fell behind
    echo_path: bool | None = None  # whether the canceller found one (None: no canceller)
    echo_reduction_db: float | None = None  # the canceller's figure over the last second
    echo_delay_ms: float | None = None  # the delay estimate it follows

    @property
    def session_echo_reduction_db(self) -> float | None:
        """The median of the per-second figure over the session."""
        return None

    @property
    def pending(self) -> int:
        """Complete caller frames waiting to be processed."""
        return 0

    def read(self) -> CallerFrame | None:
        raise NotImplementedError

    def interrupt(self) -> None:
        """Wake a waiting `read()` so that it returns None (the engine is stopping)."""


class DeviceMic(CallerSource):
    """Caller frames from a DuplexStream's microphone.

    With a `canceller` (live.echo.EchoCanceller) each frame is cleaned of the speaker's echo
    first, with exactly what the speaker was handed at the same sample positions as the far
    end and PortAudio's device delay as the estimate; the model hears the cleaned frame.
    With an `adapter` (live.rates.RateAdapter) the device's rate is resampled to 24 kHz
    after cancellation (the canceller runs at the device rate, sample-aligned with the far
    end). `read()` returns None once the stream is closed; `stream.read()` raises
    AudioDeviceError when the device goes away (its watchdog).
    """

    def __init__(self, stream, adapter=None, canceller=None):
        self.stream = stream
        self.adapter = adapter if adapter is not None and not adapter.passthrough else None
        self.canceller = canceller
        self._ready: deque = deque()  # 24 kHz frames from one resampled device block
        self._emitted = 0
        self._blocks = 0
        # The per-second figure (the echo's reduction while the caller was silent), sampled
        # once a second while there was one: its median for the session.
        self._echo_seconds = Histogram.decibels()

    @property
    def session_echo_reduction_db(self) -> float | None:
        return self._echo_seconds.percentile(50)

    @property
    def dropped(self) -> int:
        return self.stream.input.dropped_frames

    @property
    def pending(self) -> int:
        return self.stream.input.pending + len(self._ready)

    def read(self) -> CallerFrame | None:
        while not self._ready:
            got = self.stream.read()
            if got is None:
                return None
            block, pos = got
            # Audio captured after this block already waits behind it: that is its delay.
            behind = self.stream.input.captured - pos - len(block)
            delay_ms = 1000.0 * behind / self.stream.samplerate
            if self.canceller is not None:
                self.echo_delay_ms = self.stream.echo_delay_ms
                self.canceller.delay_ms = self.echo_delay_ms
                block = self.canceller.process(block, self.stream.played(pos, len(block)))
                # Read here, on this thread: the canceller is not thread-safe.
                self.echo_reduction_db = self.canceller.echo_reduction_db
                self.echo_path = self.canceller.echo_path
                self._blocks += 1
                if self.echo_reduction_db is not None and self._blocks % SECOND_FRAMES == 0:
                    self._echo_seconds.add(self.echo_reduction_db)
            if self.adapter is None:
                return CallerFrame(block, pos // self.stream.blocksize, delay_ms)
            for frame in self.adapter.to_model(block):
                self._ready.append((frame, delay_ms))
        frame, delay_ms = self._ready.popleft()
        index = self._emitted + self.stream.input.dropped_frames
        self._emitted += 1
        return CallerFrame(frame, index, delay_ms)


class DeviceClock:
    """The sound card's 80 ms cadence, for a recording that replaces the microphone while
    the assistant plays on the speaker (one clock for both sides: they never drift). The
    captured audio itself is ignored."""

    def __init__(self, stream):
        self.stream = stream

    @property
    def dropped(self) -> int:
        return self.stream.input.dropped_frames

    @property
    def pending(self) -> int:
        return self.stream.input.pending

    def tick(self) -> tuple[int, float] | None:
        got = self.stream.read()
        if got is None:
            return None
        block, pos = got
        behind = self.stream.input.captured - pos - len(block)
        return pos // self.stream.blocksize, 1000.0 * behind / self.stream.samplerate

    def interrupt(self) -> None:
        pass  # closing the stream wakes `stream.read()`


class PacedClock:
    """Real time from the system clock: frame k is due once it would have been captured,
    `(k + 1) * frame_s` after the first tick. Due frames wait in the callers' one
    drop-oldest queue (jitter.InputQueue, a sample per frame), as the device's frames do:
    past `max_pending` the oldest are skipped, counted in `dropped`."""

    def __init__(self, frame_s: float = FRAME_SECONDS, max_pending: int = CALLER_QUEUE_FRAMES,
                 clock: Callable[[], float] = time.monotonic):
        self.frame_s = frame_s
        self.max_pending = max_pending
        self._clock = clock
        self._t0: float | None = None
        self._due = InputQueue(frame_size=1, max_frames=max_pending)
        self._lock = threading.Lock()  # the view's thread asks for `pending` too
        self._wake = threading.Event()

    @property
    def dropped(self) -> int:
        return self._due.dropped_frames

    def _queue_due(self, now: float) -> None:
        """Every frame due by `now`, queued."""
        with self._lock:
            if self._t0 is None:
                return
            due = int((now - self._t0) / self.frame_s)
            if due > self._due.captured:
                self._due.push(np.zeros(due - self._due.captured, np.float32))

    @property
    def pending(self) -> int:
        self._queue_due(self._clock())
        return self._due.pending

    def tick(self) -> tuple[int, float] | None:
        if self._t0 is None:
            self._t0 = self._clock()
        while not self._wake.is_set():
            now = self._clock()
            self._queue_due(now)
            got = self._due.get_nowait()
            if got is not None:
                index = got[1]
                return index, 1000.0 * (now - self._t0 - (index + 1) * self.frame_s)
            self._wake.wait(self._t0 + (self._due.captured + 1) * self.frame_s - now)
        return None

    def interrupt(self) -> None:
        self._wake.set()


class FreeClock:
    """No pacing: every frame is due at once (benchmarks, tests)."""

    dropped = 0
    pending = 0

    def __init__(self):
        self._next = 0
        self._stopped = False

    def tick(self) -> tuple[int, float] | None:
        if self._stopped:
            return None
        self._next += 1
        return self._next - 1, 0.0

    def interrupt(self) -> None:
        self._stopped = True


class RecordingCaller(CallerSource):
    """Caller frames from a recording (audio.frames.InputFrames, or any iterable of
    [1920] float32 frames) at the clock's pace. Frames the clock drops are skipped in the
    recording too, as the microphone's would be. The answer to the last frame is trimmed
    to the recording's length (`InputFrames.samples`), as `reply` trims it."""

    def __init__(self, frames: Iterable[np.ndarray], clock=None):
        from ..audio.frames import frames_with_tail  # soundfile and soxr: only when used

        self.clock = clock if clock is not None else FreeClock()
        self._it = frames_with_tail(frames)
        self._taken = 0  # recording frames read (heard or skipped)

    @property
    def dropped(self) -> int:
        return self.clock.dropped

    @property
    def pending(self) -> int:
        return self.clock.pending

    def _next_frame(self) -> tuple[np.ndarray, int] | None:
        got = next(self._it, None)
        if got is None:
            return None
        self._taken += 1
        return np.asarray(got[0], np.float32), got[1]

    def read(self) -> CallerFrame | None:
        tick = self.clock.tick()
        if tick is None:
            return None
        index, delay_ms = tick
        while self._taken < index:  # dropped by the clock: not heard
            if self._next_frame() is None:
                return None
        got = self._next_frame()
        if got is None:
            return None
        return CallerFrame(got[0], index, delay_ms, got[1])

    def interrupt(self) -> None:
        self.clock.interrupt()


# -- sinks ----------------------------------------------------------------------------------

class Speaker:
    """Assistant frames to a DuplexStream's speaker (resampled to the device rate if needed)."""

    def __init__(self, stream, adapter=None):
        self.stream = stream
        self.adapter = adapter if adapter is not None and not adapter.passthrough else None

    def write(self, pcm: np.ndarray) -> None:
        self.stream.write(pcm if self.adapter is None else self.adapter.to_device(pcm))


# -- statistics -----------------------------------------------------------------------------

@dataclass(frozen=True)
class LiveStats:
    """One look at a running session (the view, the stats lines, the summary).

    Window figures cover the last `window_s` seconds; `session_*` the whole session.
    Device fields are None without an audio device.
    """

    elapsed_s: float
    frames: int  # model steps (caller frames heard)
    dropped: int  # caller frames dropped because the engine fell behind
    pending: int  # caller frames waiting now
    delay_ms: float | None  # capture -> processing of the latest frame
    delay_max_ms: float | None  # ... the longest in the window
    compute_p50_ms: float | None  # one conversation step, in the window
    compute_p99_ms: float | None
    rtf: float | None  # compute p50 / 80 ms: below 1 keeps up
    session_compute_p50_ms: float | None
    session_compute_p99_ms: float | None
    caller_dbfs: float  # loudest frame in the last 0.25 s (what the model heard)
    assistant_dbfs: float
    echo_path: bool | None  # the canceller found an echo path (None: no canceller)
    echo_reduction_db: float | None  # the echo's, over the last second the caller was silent
    session_echo_reduction_db: float | None  # the median of that, once a second
    echo_delay_ms: float | None
    buffer_ms: float | None  # assistant audio waiting for the speaker
    underruns: int | None  # speaker callbacks that found too little audio
    overruns: int | None  # pushes that found the speaker's buffer full
    callbacks: int | None
    expected_callbacks: int | None
    max_callback_interval_ms: float | None
    input_overflows: int | None  # PortAudio's status flags
    output_underflows: int | None

    def as_json(self) -> dict:
        return {key: round(value, 2) if isinstance(value, float) else value
                for key, value in asdict(self).items()}


@dataclass
class _FrameTimes:
    t: float
    delay_ms: float
    caller_dbfs: float
    assistant_dbfs: float


# -- the engine -----------------------------------------------------------------------------

class LiveLoop:
    """Runs `row` (a runtime.rows.SourceRow: talk's persona, sampling and seed) on
    `scheduler` (runtime's, paced by the source) on its own thread: one step per caller
    frame from `source`.

    `sink.write(pcm)` gets each assistant frame (trimmed on a recording's last frame), and
    `record(caller, assistant)` both whole frames of the step. `stream` (a DuplexStream)
    only adds its counters to `snapshot()`. `pieces` holds (frame index, text piece) for
    the main thread to take with `popleft()` (the last 10 minutes' at most).
    """

    def __init__(self, scheduler, row, source: CallerSource, sink=None, *,
                 record: Callable[[np.ndarray, np.ndarray], None] | None = None,
                 stream=None, history_s: float = 20.0):
        self.scheduler = scheduler
        self.row = row
        self.source = source
        self.sink = sink
        self.record = record
        self.stream = stream
        # Taken by the main thread every few ms; bounded all the same (10 minutes), so a
        # consumer that stalls cannot make the engine's memory grow with the session.
        self.pieces: deque[tuple[int, str]] = deque(maxlen=int(600 / FRAME_SECONDS))
        self.error: BaseException | None = None
        self.ended_by_input = False  # the source ran out (a recording's end)
        self.frames = 0  # frames handed to the sink
        self._current: CallerFrame | None = None  # the caller frame being stepped
        self._recent: deque[_FrameTimes] = deque(maxlen=max(1, int(history_s / FRAME_SECONDS)))
        self._stats_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None
        self._busy_since: float | None = None  # when the frame in work was taken

    # -- control (main thread) ----------------------------------------------------------
    def start(self) -> LiveLoop:
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="personaplex-engine",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = -1) -> None:
        """No write after this returns; a waiting `read()` is woken (for the microphone,
        closing the stream does that). A step in progress finishes on its own. With a
        `timeout`, an engine thread stuck in a write (a stalled sink) is not waited for
        longer: the stop is set all the same, and that write may still complete."""
        got = self._write_lock.acquire(timeout=timeout)
        self._stop.set()
        if got:
            self._write_lock.release()
        self.source.interrupt()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; False if it is still in a step after `timeout`."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        """True once the engine has ended (input over, stopped, or failed)."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # -- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.scheduler.follow(self.row, self._read, self._hand_out)
            self.ended_by_input = not self._stop.is_set()
        except BaseException as error:  # noqa: BLE001 - the main thread re-raises it
            self.error = error
        finally:
            self._done.set()

    def _read(self) -> np.ndarray | None:
        """The source's next frame for the runtime (None: stopped, or the input's end)."""
        self._current = None
        if self._stop.is_set():
            return None
        frame = self.source.read()
        if self._stop.is_set() or frame is None:
            return None
        self._busy_since = time.monotonic()
        self._current = frame
        return frame.pcm

    def _hand_out(self, out) -> None:
        frame = self._current
        assistant = np.asarray(out.pcm[self.row.slot], np.float32)
        with self._write_lock:
            if self._stop.is_set():
                return
            if self.sink is not None:
                self.sink.write(assistant[:frame.keep])
            if self.record is not None:
                self.record(frame.pcm, assistant)
        self._account(frame, assistant, out.pieces[self.row.slot])
        self._busy_since = None

    # -- the watchdog (main thread) -----------------------------------------------------
    def check(self, stall_s: float) -> None:
        """Raise if the session cannot go on while this thread is still waiting for it:
        EngineStalled once the engine thread has been in one frame's work (the model step,
        handing the answer on) for more than `stall_s`; the stream's AudioDeviceError once
        its callbacks stopped. The engine thread notices a lost callback itself only while
        it waits for audio, not while a step holds it."""
        busy_since = self._busy_since
        busy = 0.0 if busy_since is None else time.monotonic() - busy_since
        if busy > stall_s:
            raise EngineStalled(
                f"the engine stalled: one frame has been in work for {busy:.1f} s, more than "
                f"the {stall_s:.1f} s allowed; the compute device, or its driver, stopped "
                "answering")
        if self.stream is not None:
            self.stream.check()

    def _account(self, frame: CallerFrame, assistant: np.ndarray, piece: str) -> None:
        caller, reply = (dbfs(float(np.dot(pcm, pcm)), len(pcm)) for pcm in (frame.pcm, assistant))
        times = _FrameTimes(time.monotonic(), frame.delay_ms, caller, reply)
        with self._stats_lock:
            self.frames += 1
            self._recent.append(times)
        self.pieces.append((frame.index, piece))

    # -- reporting (any thread) ---------------------------------------------------------
    def snapshot(self, window_s: float = 5.0) -> LiveStats:
        now = time.monotonic()
        with self._stats_lock:
            frames = self.frames
            recent = [r for r in self._recent if r.t >= now - window_s]
            level = [r for r in self._recent if r.t >= now - 0.25] or list(self._recent)[-1:]
        steps = self.scheduler.stats  # the runtime's one measure, as serve's /metrics reads it
        p50, p99 = (steps.step_ms(q, window_s) for q in (0.5, 0.99))
        device = self.stream.stats() if self.stream is not None else None
        return LiveStats(
            elapsed_s=0.0 if self._started_at is None else now - self._started_at,
            frames=frames, dropped=self.source.dropped, pending=self.source.pending,
            delay_ms=recent[-1].delay_ms if recent else None,
            delay_max_ms=max(r.delay_ms for r in recent) if recent else None,
            compute_p50_ms=p50, compute_p99_ms=p99,
            rtf=steps.real_time_factor(window_s),
            session_compute_p50_ms=steps.session_ms(0.5),
            session_compute_p99_ms=steps.session_ms(0.99),
            caller_dbfs=max((r.caller_dbfs for r in level), default=SILENCE_DBFS),
            assistant_dbfs=max((r.assistant_dbfs for r in level), default=SILENCE_DBFS),
            echo_path=self.source.echo_path,
            echo_reduction_db=self.source.echo_reduction_db,
            session_echo_reduction_db=self.source.session_echo_reduction_db,
            echo_delay_ms=self.source.echo_delay_ms,
            buffer_ms=None if device is None else device.output.depth_ms,
            underruns=None if device is None else device.output.underruns,
            overruns=None if device is None else device.output.overruns,
            callbacks=None if device is None else device.callbacks,
            expected_callbacks=None if device is None else device.expected_callbacks,
            max_callback_interval_ms=None if device is None else device.max_interval_ms,
            input_overflows=None if device is None else device.input_overflows,
            output_underflows=None if device is None else device.output_underflows)
