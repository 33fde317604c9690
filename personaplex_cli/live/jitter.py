"""Where the audio callback and the inference thread meet: two bounded sample rings.

- `OutputJitterBuffer` (model -> speaker): the inference side pushes frames (1920 samples at
  24 kHz, or resampled chunks of any length); the audio callback pulls exactly the `n` samples
  it must play, silence on underrun. It keeps a record of exactly what it handed out, indexed
  by absolute sample position, so the echo canceller's far-end reference is what really went
  to the speaker (silence and dropped audio included).
- `InputQueue` (caller -> model): the callback pushes blocks of any length; the inference side
  takes whole frames, each with its absolute start position. When the engine is slower than
  real time the oldest frames are dropped and counted, so latency stays bounded. It is the
  one drop-oldest queue of every caller: talk's microphone and paced recording, serve's
  network callers (runtime.rows.LiveRow).

Both count samples from the stream start. A full-duplex callback moves the same number of
input and output samples, so a mic frame starting at position `p` was captured while
`played(p, n)` was being handed to the output: that is how the two sides pair up.

Threading: one lock per ring, held only for a slice copy of at most a few thousand samples
(microseconds); the callback never waits for anything else and allocates nothing (copies go
into preallocated rings through views). Everything is numpy only, testable without hardware.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..core.config import FRAME_SIZE, SAMPLE_RATE

# Caller frames that may wait for the model before the oldest is dropped (InputQueue, the one
# drop-oldest queue of every caller: talk's microphone or recording, serve's network
# callers): 320 ms of the caller's voice at most reaches the model late, rather than later
# and later.
CALLER_QUEUE_FRAMES = 4
# Assistant audio that may wait for its listener beyond what plays now (talk's speaker, past
# its --buffer; serve's client, past the frame being sent) before the oldest is dropped:
# room for a burst of frames from a scheduler that caught up (CALLER_QUEUE_FRAMES of them)
# without dropping any.
ASSISTANT_QUEUE_MS = 480.0


def ring_write(ring: np.ndarray, pos: int, x: np.ndarray) -> None:
    """Copy `x` into `ring` starting at absolute position `pos` (wrapping); len(x) <= len(ring)."""
    cap = len(ring)
    i = pos % cap
    first = min(len(x), cap - i)
    ring[i:i + first] = x[:first]
    if first < len(x):
        ring[:len(x) - first] = x[first:]


def ring_read(ring: np.ndarray, pos: int, out: np.ndarray) -> None:
    """Fill `out` from `ring` starting at absolute position `pos` (wrapping); len(out) <= len(ring)."""
    cap = len(ring)
    i = pos % cap
    first = min(len(out), cap - i)
    out[:first] = ring[i:i + first]
    if first < len(out):
        out[first:] = ring[:len(out) - first]


def _samples(ms: float, sample_rate: int) -> int:
    return int(round(ms * sample_rate / 1000))


@dataclass(frozen=True)
class OutputStats:
    pushed: int  # samples pushed by the inference side
    handed_out: int  # samples given to the audio callback, silence included
    underruns: int  # callbacks that found too little (once playback had started)
    underrun_samples: int  # silence samples those callbacks got instead of audio
    overruns: int  # pushes that found the buffer full and dropped its oldest samples
    dropped_samples: int  # samples dropped that way (never played)
    depth_ms: float  # audio waiting to be played


class OutputJitterBuffer:
    """Bounded FIFO from the inference thread to the audio callback, with a playback record.

    `capacity_ms` bounds the depth (the added output latency): a push that does not fit drops
    the oldest waiting samples. `prefill_ms` is how much must be waiting before playback
    starts, and starts again after an underrun (0: play whatever is there). `record_ms` is how
    far back `played()` can look (it must cover the input queue plus a frame).
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE, capacity_ms: float = ASSISTANT_QUEUE_MS,
                 prefill_ms: float = 0.0, record_ms: float = 2000.0):
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.sample_rate = sample_rate
        self.capacity = _samples(capacity_ms, sample_rate)
        self.prefill = _samples(prefill_ms, sample_rate)
        if self.capacity < 1:
            raise ValueError(f"capacity_ms is too small: {capacity_ms}")
        if self.prefill > self.capacity:
            raise ValueError(f"prefill_ms ({prefill_ms}) exceeds capacity_ms ({capacity_ms})")
        self._ring = np.zeros(self.capacity, np.float32)
        self._record = np.zeros(max(1, _samples(record_ms, sample_rate)), np.float32)
        self._lock = threading.Lock()
        self._read = 0  # absolute index (in pushed samples) of the next sample to play
        self._write = 0  # absolute index one past the last pushed sample
        self._handed_out = 0  # absolute output position: samples handed to the callback
        self._playing = False  # False before playback starts and while refilling to prefill
        self._started = False  # playback started once: underruns count from then on
        self.underruns = 0
        self.underrun_samples = 0
        self.overruns = 0
        self.dropped_samples = 0

    # -- inference side -------------------------------------------------------------------
    def push(self, frame: np.ndarray) -> None:
        """Queue samples for playback; when full, the oldest waiting samples are dropped."""
        x = np.asarray(frame, dtype=np.float32).reshape(-1)
        if len(x) == 0:
            return
        with self._lock:
            depth = self._write - self._read
            overflow = depth + len(x) - self.capacity
            if overflow > 0:
                self.overruns += 1
                self.dropped_samples += overflow
                if len(x) > self.capacity:  # the frame alone overflows: only its tail can stay
                    skipped = len(x) - self.capacity
                    self._read = self._write + skipped
                    self._write += skipped
                    x = x[skipped:]
                else:
                    self._read += overflow
            ring_write(self._ring, self._write, x)
            self._write += len(x)

    def clear(self) -> None:
        """Drop everything waiting (not counted as dropped): e.g. when the model resets."""
        with self._lock:
            self._read = self._write
            self._playing = False

    # -- audio callback side --------------------------------------------------------------
    def pull_into(self, out: np.ndarray) -> None:
        """Fill `out` (a 1-D float32 view, e.g. `outdata[:, 0]`) with the next samples.

        Never blocks beyond the short lock and never allocates: short of audio, the rest is
        silence and an underrun is counted (once playback has started: the silence before
        the first audio is not one). What was written is kept in the record.
        """
        n = len(out)
        with self._lock:
            depth = self._write - self._read
            if not self._playing and depth >= max(self.prefill, 1):
                self._playing = self._started = True
            take = min(n, depth) if self._playing else 0
            if take:
                ring_read(self._ring, self._read, out[:take])
                self._read += take
            if take < n:
                out[take:] = 0.0
                if self._started:
                    self.underruns += 1
                    self.underrun_samples += n - take
                # Refill to the prefill before playing again, so that one late frame does
                # not turn into a run of chopped ones (with prefill 0: as soon as any arrives).
                self._playing = False
            self._remember(out)

    def pull(self, n: int) -> np.ndarray:
        """`pull_into` a new array of `n` samples (for tests and non-callback callers)."""
        out = np.empty(n, np.float32)
        self.pull_into(out)
        return out

    def _remember(self, out: np.ndarray) -> None:
        rec = self._record
        n = len(out)
        if n >= len(rec):
            ring_write(rec, self._handed_out + n - len(rec), out[n - len(rec):])
        else:
            ring_write(rec, self._handed_out, out)
        self._handed_out += n

    # -- echo-canceller side --------------------------------------------------------------
    def played(self, start: int, n: int) -> np.ndarray:
        """What was handed to the output at absolute positions [start, start + n).

        Positions not handed out yet, or older than the record, read as silence.
        """
        out = np.zeros(n, np.float32)
        with self._lock:
            end = self._handed_out
            lo = max(start, end - len(self._record), 0)
            hi = min(start + n, end)
            if hi > lo:
                ring_read(self._record, lo, out[lo - start:hi - start])
        return out

    # -- reporting ------------------------------------------------------------------------
    @property
    def handed_out(self) -> int:
        """Absolute output position: samples handed to the callback so far, silence included."""
        return self._handed_out

    @property
    def depth(self) -> int:
        """Samples waiting to be played."""
        return self._write - self._read

    @property
    def depth_ms(self) -> float:
        return 1000.0 * self.depth / self.sample_rate

    def stats(self) -> OutputStats:
        with self._lock:
            return OutputStats(self._write, self._handed_out, self.underruns, self.underrun_samples,
                               self.overruns, self.dropped_samples, self.depth_ms)


@dataclass(frozen=True)
class InputStats:
    captured: int  # samples pushed by the callback
    frames_taken: int  # frames handed to the inference side
    dropped_frames: int  # frames dropped because the inference side fell behind
    pending_frames: int  # complete frames waiting now
    depth_ms: float  # audio waiting (complete frames and the partial one)


class InputQueue:
    """Bounded queue of fixed-size frames from the audio callback to the inference thread.

    The callback pushes blocks of any length; `get()` returns whole frames of `frame_size`
    with their absolute start position. At most `max_frames` complete frames wait: when the
    engine falls behind, the oldest are dropped and counted, so the caller's voice reaches the
    model at most `max_frames` frames late instead of later and later.
    """

    def __init__(self, frame_size: int = FRAME_SIZE, max_frames: int = CALLER_QUEUE_FRAMES,
                 sample_rate: int = SAMPLE_RATE):
        if frame_size < 1 or max_frames < 1:
            raise ValueError(f"frame_size and max_frames must be >= 1, got {frame_size}, {max_frames}")
        self.frame_size = frame_size
        self.max_frames = max_frames
        self.sample_rate = sample_rate
        # max_frames complete frames plus one partial one never exceed this.
        self._ring = np.zeros((max_frames + 1) * frame_size, np.float32)
        self._cond = threading.Condition(threading.Lock())
        self._read = 0  # absolute start of the oldest waiting frame (a multiple of frame_size)
        self._write = 0  # absolute count of samples pushed
        self.frames_taken = 0
        self.dropped_frames = 0
        self._closed = False

    # -- audio callback side --------------------------------------------------------------
    def push(self, block: np.ndarray) -> None:
        """Append captured samples (a 1-D float32 view such as `indata[:, 0]`); never blocks
        beyond the short lock and allocates nothing."""
        n = len(block)
        if n == 0:
            return
        f = self.frame_size
        with self._cond:
            new_write = self._write + n
            # Keep at most max_frames complete frames: the oldest ones go first.
            keep_from = (new_write // f - self.max_frames) * f
            if keep_from > self._read:
                self.dropped_frames += (keep_from - self._read) // f
                self._read = keep_from
            skip = max(0, self._read - self._write)  # leading samples of a huge block nobody keeps
            if skip < n:
                ring_write(self._ring, self._write + skip, block[skip:])
            had = self._write // f
            self._write = new_write
            if new_write // f > had:
                self._cond.notify()

    # -- inference side -------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> tuple[np.ndarray, int] | None:
        """Next frame and its absolute start position; None on timeout or after `close()`."""
        with self._cond:
            if not self._has_frame() and not self._closed:
                self._cond.wait_for(lambda: self._has_frame() or self._closed, timeout)
            if not self._has_frame():
                return None
            frame = np.empty(self.frame_size, np.float32)
            ring_read(self._ring, self._read, frame)
            pos = self._read
            self._read += self.frame_size
            self.frames_taken += 1
            return frame, pos

    def get_nowait(self) -> tuple[np.ndarray, int] | None:
        return self.get(timeout=0)

    def close(self) -> None:
        """Wake any waiting `get()` (it returns None once the waiting frames are taken)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drop_oldest(self, frames: int = 1) -> None:
        """The oldest waiting frames go, counted: latency a stall left behind."""
        with self._cond:
            gone = min(frames, (self._write - self._read) // self.frame_size)
            self._read += gone * self.frame_size
            self.dropped_frames += gone

    def clear(self) -> None:
        """Drop the waiting complete frames (not counted as dropped)."""
        with self._cond:
            self._read = self._write // self.frame_size * self.frame_size

    def _has_frame(self) -> bool:
        return self._write - self._read >= self.frame_size

    # -- reporting ------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Complete frames waiting."""
        return (self._write - self._read) // self.frame_size

    @property
    def captured(self) -> int:
        return self._write

    @property
    def depth_ms(self) -> float:
        return 1000.0 * (self._write - self._read) / self.sample_rate

    def stats(self) -> InputStats:
        with self._cond:
            return InputStats(self._write, self.frames_taken, self.dropped_frames, self.pending,
                              self.depth_ms)
