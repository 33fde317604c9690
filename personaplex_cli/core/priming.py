"""Priming a stream with its persona, as NVIDIA's `LMGen.step_system_prompts` does it.

Phases, every token forced (sampling during priming only draws randomness, so the
depformer's chain, whose samples nobody would read, is skipped):
  voice prompt   Mimi codes of the voice recording as the assistant's audio (or the stored
                 input embeddings of a .pt voice), text PAD, the caller hears a sine tone;
  silence        6 frames of the assistant's silence codes, text PAD;
  role prompt    the `<system> ... <system>` tokens, one per frame, assistant silent;
  silence        6 frames again.
`steps` runs them one generator step at a time, so a caller can spread priming over time;
`Primer` runs several personas' priming side by side, one step of a small batch for all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .config import TEXT_PAD
from .generator import FrameGenerator

# Mimi codes of an 80 ms silent frame and of a 440 Hz sine frame (NVIDIA's constants).
SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)
SILENCE_FRAMES = 6  # int(0.5 s * 12.5 Hz)


@dataclass
class VoiceEmbeddings:
    """A .pt voice: per-frame summed input embeddings [E, 1, 1, dim] and the token ring
    [1, 17, 4] at the end of the voice phase."""

    embeddings: torch.Tensor
    cache: torch.Tensor


@dataclass(frozen=True)
class PersonaTokens:
    """A persona as the engine takes it: the voice as Mimi codes [8, N] of its recording or
    as a .pt's stored embeddings (or neither), and the role prompt's tokens."""

    text_tokens: tuple[int, ...] = ()
    voice_codes: torch.Tensor | None = None
    voice: VoiceEmbeddings | None = None

    @property
    def voice_steps(self) -> int:
        if self.voice is not None:
            return len(self.voice.embeddings)
        return 0 if self.voice_codes is None else self.voice_codes.shape[1]

    @property
    def steps(self) -> int:
        return priming_steps(self.voice_steps, len(self.text_tokens))


def priming_steps(voice_steps: int, text_tokens: int) -> int:
    """Generator steps the priming takes: voice, silence, role prompt, silence."""
    return voice_steps + 2 * SILENCE_FRAMES + text_tokens


def _frame(tokens: tuple[int, ...], gen: FrameGenerator) -> torch.Tensor:
    return torch.tensor(tokens, device=gen.device).expand(gen.batch, -1)


def steps(gen: FrameGenerator, persona: PersonaTokens) -> Iterator[None]:
    """Primes every row of `gen` (fresh) with `persona`, yielding after each step."""
    sine, silence = _frame(SINE_TOKENS, gen), _frame(SILENCE_TOKENS, gen)
    if persona.voice is not None:
        for embedding in persona.voice.embeddings:
            gen.step_embedding(embedding.expand(gen.batch, -1, -1))
            yield
        gen.cache.copy_(persona.voice.cache.to(gen.device).expand_as(gen.cache))
    elif persona.voice_codes is not None:
        for t in range(persona.voice_codes.shape[1]):
            agent = persona.voice_codes[:, t].to(gen.device).expand(gen.batch, -1)
            gen.step(user=sine, agent=agent, text=TEXT_PAD, depformer=False)
            yield
    phases = ([TEXT_PAD] * SILENCE_FRAMES, list(persona.text_tokens),
              [TEXT_PAD] * SILENCE_FRAMES)
    for token in (token for phase in phases for token in phase):
        gen.step(user=sine, agent=silence, text=token, depformer=False)
        yield


def prime(gen: FrameGenerator, persona: PersonaTokens) -> None:
    """All four phases at once. No voice at all is allowed (the phase is skipped)."""
    for _ in steps(gen, persona):
        pass


def record_voice(gen: FrameGenerator, codes: torch.Tensor) -> VoiceEmbeddings:
    """The voice phase from Mimi codes [8, N] on a fresh one-row generator, returning what
    a .pt voice stores: the input embedding of every step that ran (the first runs none)."""
    sine = _frame(SINE_TOKENS, gen)
    embeddings = []
    for t in range(codes.shape[1]):
        gen.step(user=sine, agent=codes[:, t].to(gen.device).expand(gen.batch, -1),
                 text=TEXT_PAD, depformer=False)
        if gen.last_embedding is not None:
            embeddings.append(gen.last_embedding.cpu())
    return VoiceEmbeddings(torch.stack(embeddings), gen.cache.cpu())


@dataclass
class _Lane:
    persona: PersonaTokens
    position: int = 0  # priming steps done; the next one's index


class Primer:
    """Primes up to `gen.batch` personas side by side: each `step` is one generator step of
    all the seated rows, every row at its own place in its own persona's phases. A row's
    priming equals the same persona primed alone by `steps` (tests/test_slots.py): a
    stream's first frame runs no model, so a fresh row is opened alone (`open_row`), and a
    .pt voice's rows replay their stored embeddings while the others embed their tokens.

    Rows hold no sampling: priming draws noise nobody reads, so a joining stream's generator
    is moved on afterwards by the frames that ran (sampling.advance_rng), and one priming
    serves every stream of that persona."""

    def __init__(self, gen: FrameGenerator):
        self.gen = gen
        self.rows = gen.batch
        self._lanes: list[_Lane | None] = [None] * gen.batch
        device = gen.device
        self._sine = torch.tensor(SINE_TOKENS, device=device)
        self._silence = torch.tensor(SILENCE_TOKENS, device=device)
        # What a stored embedding's step forces, as step_embedding does: all overwritten.
        self._initial_user = gen.initial[gen.user_rows]
        self._initial_agent = gen.initial[gen.agent_rows]
        self._views: dict[int, FrameGenerator] = {}

    def free_rows(self) -> list[int]:
        return [row for row, lane in enumerate(self._lanes) if lane is None]

    def position(self, row: int) -> int:
        return self._lanes[row].position

    def done(self, row: int) -> bool:
        lane = self._lanes[row]
        return lane.position >= lane.persona.steps

    def seat(self, row: int, persona: PersonaTokens, parked: tuple | None = None,
             position: int = 0) -> None:
        """Row `row` primes `persona`: from the start, or from where `park` left it."""
        if parked is not None:
            self.gen.restore(row, parked)
            self._lanes[row] = _Lane(persona, position)
            return
        self.gen.reset([row])
        lane = self._lanes[row] = _Lane(persona)
        self._copy_voice_when_due(row, lane)
        user, agent, text, embedding = self._input(persona, 0)
        if embedding is None:
            self.gen.open_row(row, user, agent, text)
            lane.position = 1
        else:  # the stored embedding of frame 0 runs with the next step, as step_embedding
            self.gen.open_row(row, self._initial_user, self._initial_agent, TEXT_PAD)

    def park(self, row: int) -> tuple:
        """Frees the row, returning its half-primed state for `seat`."""
        saved = self.gen.save(row)
        self._lanes[row] = None
        return saved

    def finish(self, row: int) -> tuple[tuple, int]:
        """Frees a row whose priming is done -> (its state, FrameGenerator.save, and the
        frames that ran)."""
        saved = (self.gen.save(row), int(self.gen.offsets[row]) - 1)
        self._lanes[row] = None
        return saved

    def vacate(self, row: int) -> None:
        self._lanes[row] = None

    def step(self) -> None:
        """One priming step of every seated row whose priming is not done."""
        active = [row for row, lane in enumerate(self._lanes)
                  if lane is not None and lane.position < lane.persona.steps]
        if not active:
            return
        n = self.gen.rows_for(active[-1] + 1)  # a graphed one's smallest batch that covers
        gen = self.gen if n == self.rows else self._first_rows(n)
        user = self._sine.expand(n, -1).clone()
        agent = self._silence.expand(n, -1).clone()  # spare rows: anything valid
        text = torch.full((n,), TEXT_PAD, dtype=torch.long, device=self.gen.device)
        stored = torch.zeros(n, dtype=torch.bool)
        embeddings = None
        for row in active:
            lane = self._lanes[row]
            user[row], agent[row], text[row], embedding = self._input(lane.persona,
                                                                      lane.position)
            if embedding is not None:
                if embeddings is None:
                    embeddings = torch.zeros(n, 1, embedding.shape[-1], dtype=embedding.dtype)
                stored[row] = True
                embeddings[row] = embedding.reshape(1, -1)
        gen.step_forced(user, agent, text, stored if embeddings is not None else None,
                        embeddings)
        for row in active:
            lane = self._lanes[row]
            lane.position += 1
            self._copy_voice_when_due(row, lane)

    def _first_rows(self, rows: int) -> FrameGenerator:
        if rows not in self._views:
            self._views[rows] = self.gen.first_rows(rows)
        return self._views[rows]

    def _copy_voice_when_due(self, row: int, lane: _Lane) -> None:
        voice = lane.persona.voice
        if voice is not None and lane.position == len(voice.embeddings):
            self.gen.cache[row] = voice.cache[0].to(self.gen.device)

    def _input(self, persona: PersonaTokens, index: int):
        """Priming step `index` of `persona` -> (user [8], agent [8], text, stored
        embedding or None), as `steps` feeds it."""
        voice_steps = persona.voice_steps
        if index < voice_steps:
            if persona.voice is not None:
                return (self._initial_user, self._initial_agent, TEXT_PAD,
                        persona.voice.embeddings[index])
            return self._sine, persona.voice_codes[:, index].to(self.gen.device), TEXT_PAD, None
        index -= voice_steps + SILENCE_FRAMES
        text = persona.text_tokens
        token = text[index] if 0 <= index < len(text) else TEXT_PAD
        return self._sine, self._silence, token, None
