"""Conversations with a persona: the voice and role primed into the model, then the caller's
80 ms frames in and the assistant's frames, codes and inner-monologue text out.

The layer between the engine (core/session.py) and the commands: `reply` runs recordings
through `reply_stream`, several in lockstep; `talk` steps a `Conversation` live; `voices
create` records the voice phase. What a persona is, how it is checked and primed, and how
one frame becomes text, lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from .audio.frames import InputFrames, frames_with_tail
from .core.config import ASSISTANT_CODES, FRAME_RATE, FRAME_SIZE, SAMPLE_RATE
from .core.priming import SILENCE_FRAMES, VoiceEmbeddings, prime_voice_codes
from .core.generator import FrameGenerator
from .core.sampling import Sampling, make_rng
from .core.session import Session, encode_voice
from .errors import InputError, PersonaplexError
from .model.model import Model
from .prompts.text import DEFAULT_ROLE
from .prompts.voices import Voice


@dataclass(frozen=True)
class Persona:
    """Who the assistant is: a voice (None: no voice prompt at all) and a role text."""

    voice: Voice | None
    role: str = DEFAULT_ROLE


@dataclass
class PersonaPrompt:
    """A persona made ready for one model: the voice as a 24 kHz recording or as a .pt's
    stored embeddings, and the role prompt as tokens."""

    text_tokens: list[int]
    voice_pcm: torch.Tensor | None = None
    voice_embeddings: VoiceEmbeddings | None = None

    @property
    def voice_frames(self) -> int:
        if self.voice_embeddings is not None:
            return len(self.voice_embeddings.embeddings) + 1
        if self.voice_pcm is not None:
            return -(-len(self.voice_pcm) // FRAME_SIZE)
        return 0

    @property
    def frames(self) -> int:
        """Frames the priming takes: voice, silence, role prompt, silence."""
        return self.voice_frames + 2 * SILENCE_FRAMES + len(self.text_tokens)


def prepare_persona(model: Model, persona: Persona) -> PersonaPrompt:
    """Reads the voice, tokenizes the role, and checks both against this model."""
    from .prompts.voice import load_voice_pt, read_voice_audio

    lm = model.lm
    prompt = PersonaPrompt(model.tokenizer.role_prompt(persona.role))
    if len(prompt.text_tokens) + 2 * SILENCE_FRAMES > lm.context:
        raise InputError(f"the role prompt is {len(prompt.text_tokens)} tokens; with its "
                         f"silences it needs more than the model's context of {lm.context} "
                         f"frames ({lm.context / FRAME_RATE:.0f} s): shorten it")
    voice = persona.voice
    if voice is None:
        return prompt
    if voice.kind == "pt":
        stored = load_voice_pt(voice.path)
        dim = lm.out_norm.alpha.shape[-1]
        if stored.embeddings.shape[-1] != dim or stored.cache.shape[1] != lm.num_streams:
            raise InputError(f"voice {voice.name} ({voice.path}) was made for another model "
                             f"(embeddings of size {stored.embeddings.shape[-1]}, this model's "
                             f"are {dim})")
        prompt.voice_embeddings = VoiceEmbeddings(stored.embeddings.to(model.dtype),
                                                  stored.cache)
    else:
        prompt.voice_pcm = torch.from_numpy(read_voice_audio(str(voice.path), SAMPLE_RATE))
    return prompt


def record_voice(model: Model, recording: np.ndarray) -> VoiceEmbeddings:
    """The voice phase of a normalised 24 kHz recording, as a .pt voice stores it."""
    codes = encode_voice(model.mimi, torch.from_numpy(recording))
    gen = FrameGenerator(model.lm, Sampling(greedy=True))
    return prime_voice_codes(gen, codes, record=True)


@dataclass
class Frame:
    """One step of B streams: the assistant's audio [B, 1920], its tokens [B, 17] (text,
    assistant codes 1..8, caller codes 9..16) and the text pieces."""

    pcm: np.ndarray
    tokens: np.ndarray
    pieces: list[str]


class Conversation:
    """B streams sharing one persona, in lockstep. `start(seeds)` primes them (again: a new
    conversation reuses the session and its graphs); `step` takes one frame of each."""

    def __init__(self, model: Model, prompt: PersonaPrompt, sampling: Sampling = Sampling(),
                 *, batch: int = 1, graphs: bool | None = None):
        self.model = model
        self.prompt = prompt
        self.batch = batch
        rngs = [make_rng(model.device, 0) for _ in range(batch)]
        self.session = Session(model.mimi, model.lm, sampling, generator=rngs, batch=batch,
                               graphs=graphs)
        self._started = False

    def start(self, seeds: Sequence[int | torch.Tensor | None]) -> None:
        """Primes every stream; stream b draws from its own generator seeded with seeds[b]
        (None: fresh entropy; a tensor: a saved generator state to resume), so what it says
        never depends on its batch mates."""
        if len(seeds) != self.batch:
            raise ValueError(f"{len(seeds)} seeds for {self.batch} streams")
        if self._started:
            self.session.reset()
        for rng, seed in zip(self.session.rngs, seeds):
            if seed is None:
                rng.seed()
            elif isinstance(seed, torch.Tensor):
                rng.set_state(seed)
            else:
                rng.manual_seed(seed)
        self.session.prime(voice_pcm=self.prompt.voice_pcm,
                           voice=self.prompt.voice_embeddings,
                           text_tokens=self.prompt.text_tokens)
        self._started = True

    def step(self, pcm: np.ndarray) -> Frame:
        """pcm [B, 1920] float32, the caller -> the assistant's frame."""
        audio, tokens = self.session.step(torch.from_numpy(np.ascontiguousarray(pcm)))
        tokens = tokens.numpy()
        piece = self.model.tokenizer.piece
        return Frame(audio.numpy(), tokens, [piece(t) for t in tokens[:, 0]])


class SlotsFull(PersonaplexError):
    """Every row of the batch holds a conversation."""


class Slots:
    """A batch of `capacity` rows, each its own conversation with its own persona, sampling
    and seed: streams join a free row and leave it while the others go on.

    `join` primes a row at once; `begin` queues the priming and `prime(max_frames)` advances
    it between steps, so that the rows already talking keep their cadence. `step` takes one
    frame for every row and returns one for every row; only the live rows' mean anything.
    """

    def __init__(self, model: Model, capacity: int, *, graphs: bool | None = None):
        if capacity < 1:
            raise ValueError("a batch needs at least one row")
        self.model = model
        self.capacity = capacity
        self._graphs = graphs
        # Interim engine: one batch-1 session per row, stepped one after another.
        self._rows: list[Conversation | None] = [None] * capacity
        self._state = ["free"] * capacity  # free | joining | live
        self._queue: list[tuple[int, PersonaPrompt, Sampling, int | None]] = []

    def free(self) -> int:
        return self._state.count("free")

    def live(self) -> list[int]:
        return [slot for slot, state in enumerate(self._state) if state == "live"]

    def begin(self, prompt: PersonaPrompt, sampling: Sampling = Sampling(),
              seed: int | None = None) -> int:
        """Reserves a row for a new conversation and queues its priming -> the slot."""
        if "free" not in self._state:
            raise SlotsFull(f"all {self.capacity} conversation slots are taken")
        slot = self._state.index("free")
        self._state[slot] = "joining"
        self._queue.append((slot, prompt, sampling, seed))
        return slot

    def pending_frames(self) -> int:
        """Priming frames still to run for the queued joins."""
        return sum(prompt.frames for _, prompt, _, _ in self._queue)

    def prime(self, max_frames: int) -> list[int]:
        """Primes queued joins, first come first served -> the slots that went live."""
        went_live = []
        while self._queue and max_frames > 0:
            slot, prompt, sampling, seed = self._queue.pop(0)
            row = Conversation(self.model, prompt, sampling, graphs=self._graphs)
            row.start([seed])
            self._rows[slot] = row
            self._state[slot] = "live"
            went_live.append(slot)
            max_frames -= prompt.frames
        return went_live

    def join(self, prompt: PersonaPrompt, sampling: Sampling = Sampling(),
             seed: int | None = None) -> int:
        """A new conversation in a free row, primed -> its slot."""
        slot = self.begin(prompt, sampling, seed)
        while self._state[slot] != "live":
            self.prime(self.pending_frames())
        return slot

    def leave(self, slot: int) -> None:
        """Frees the row at once (a queued join is dropped)."""
        self._queue = [item for item in self._queue if item[0] != slot]
        self._rows[slot] = None
        self._state[slot] = "free"

    def step(self, pcm: np.ndarray) -> Frame:
        """pcm [capacity, 1920] float32, the callers (rows not live: any value) -> one
        Frame of `capacity` rows; a row that is not live holds silence and PAD."""
        audio = np.zeros((self.capacity, FRAME_SIZE), np.float32)
        tokens = np.zeros((self.capacity, len(self.model.lm.delays)), np.int64)
        pieces = [""] * self.capacity
        for slot in self.live():
            frame = self._rows[slot].step(pcm[slot:slot + 1])
            audio[slot], tokens[slot], pieces[slot] = frame.pcm[0], frame.tokens[0], \
                frame.pieces[0]
        return Frame(audio, tokens, pieces)


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


def reply_stream(conversation: Conversation, inputs: Sequence[InputFrames], *,
                 tail_samples: int = 0) -> Iterator[list[ReplyFrame | None]]:
    """Replies to up to B recordings at once, in lockstep: each step yields one ReplyFrame
    per stream (None for a stream that has ended, or a row no input fills). Shorter inputs
    are padded with silence; each reply is exactly as long as its input plus the tail."""
    if len(inputs) > conversation.batch:
        raise ValueError(f"{len(inputs)} inputs for a batch of {conversation.batch}")
    streams: list[Iterator | None] = [frames_with_tail(frames, tail_samples)
                                      for frames in inputs]
    streams += [None] * (conversation.batch - len(streams))
    pcm = np.zeros((conversation.batch, FRAME_SIZE), np.float32)
    keep = [0] * conversation.batch
    index = 0
    while True:
        for b, stream in enumerate(streams):
            item = next(stream, None) if stream is not None else None
            if item is None:
                streams[b] = None
                pcm[b] = 0.0
                keep[b] = 0
            else:
                pcm[b], keep[b] = item
        if all(stream is None for stream in streams):
            return
        frame = conversation.step(pcm)
        yield [ReplyFrame(index, frame.pcm[b, :keep[b]], frame.tokens[b], frame.pieces[b])
               if streams[b] is not None else None for b in range(conversation.batch)]
        index += 1

