"""A conversation on the scheduler, from its admission to its last frame: the one `Row`
record and its one state, with the sources its frames come from, and what a step hands back.

Sources, one subclass each: `LiveRow` (frames arrive on their own: a network caller),
`SourceRow` (frames come when its source gives them: talk's microphone or recording),
`RecordingRow` (a recording read as fast as the device steps: reply, the Ray workers) and
`OfflineRow` (a recording whose answer collects in the row: serve's POST /api/reply).

Only numpy and the standard library at import: talk's loop and serve's calls build rows
without loading torch here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator

import numpy as np

from ..core.config import ASSISTANT_CODES, FRAME_SIZE
from ..live.jitter import CALLER_QUEUE_FRAMES, InputQueue

# After a stall the queue would stay as deep as the stall left it (a frame comes and goes
# each tick), and the caller's latency with it: a queue deeper than this for this many
# ticks in a row loses its oldest frame.
INPUT_TARGET_FRAMES = 2
INPUT_SHRINK_TICKS = 25  # 2 s


class RowState(enum.Enum):
    WAITING = "waiting"  # submitted, no slot yet
    PRIMING = "priming"  # in a slot, its persona being primed
    LIVE = "live"  # stepped with the others
    ENDED = "ended"  # its source ended, it left, or it was refused


class Row:
    """One conversation: what it is (persona prompt, sampling, seed), where it is (slot,
    state) and what it did (frames, late). The scheduler's thread sets `slot` and `state`
    and calls `take`; anyone may read the counters. `owner` is the submitter's own
    business (serve's Call, a reply's future, a manifest row's key).

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
        """The persona's key in the cache of primed personas."""
        return getattr(self.prompt, "key", None)

    @property
    def live(self) -> bool:
        return self.state is RowState.LIVE

    def take(self) -> np.ndarray | None:
        """The row's next caller frame [1920] float32 (None: none now, or the end)."""
        raise NotImplementedError


class LiveRow(Row):
    """A network caller: frames arrive from the asyncio thread into the callers' one
    drop-oldest queue (live.jitter.InputQueue, talk's microphone's too); when it is full
    the oldest frame goes (counted), so latency stays bounded."""

    realtime = True

    def __init__(self, prompt, sampling, seed: int | None,
                 capacity: int = CALLER_QUEUE_FRAMES):
        super().__init__(prompt, sampling, seed)
        self._frames = InputQueue(FRAME_SIZE, capacity)
        self.started = False  # a first frame has come: from then on, a missing one is late
        self._deep_ticks = 0

    def put(self, frame: np.ndarray) -> None:
        self._frames.push(frame)
        self.started = True

    def take(self) -> np.ndarray | None:
        self._deep_ticks = self._deep_ticks + 1 if self.waiting > INPUT_TARGET_FRAMES else 0
        if self._deep_ticks >= INPUT_SHRINK_TICKS:
            self._frames.drop_oldest()
            self._deep_ticks = 0
        got = self._frames.get_nowait()
        return None if got is None else got[0]

    @property
    def dropped_in(self) -> int:
        return self._frames.dropped_frames

    @property
    def waiting(self) -> int:
        return self._frames.pending


class SourceRow(Row):
    """talk's row: its frames are its source's, taken when the source gives them
    (`read()` waits for the next one: the sound card's clock paces the row)."""

    def __init__(self, prompt, sampling, seed):
        super().__init__(prompt, sampling, seed)
        self.read: Callable[[], np.ndarray | None] = lambda: None

    def take(self) -> np.ndarray | None:
        return self.read()


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


# -- what a step hands back -----------------------------------------------------------------

@dataclass
class Frame:
    """One step of B rows: the assistant's audio [B, 1920], its tokens [B, 17] (text,
    assistant codes 1..8, caller codes 9..16) and the text pieces (rows without a stream
    say nothing)."""

    pcm: np.ndarray
    tokens: np.ndarray
    pieces: list[str]


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
    prompt: Any  # prompts.persona.PersonaPrompt
    sampling: Any = None  # core.sampling.Sampling (None: the default)
    seed: Any = None  # an int, None, or a saved generator state (see Scheduler.begin)
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
    its rows stay busy to the end (bench/reply.py's "mixed" case measures it). Ties keep
    their order."""
    def key(item) -> float:
        frames = length(item)
        return -math.inf if frames is None else -frames

    return sorted(items, key=key)
