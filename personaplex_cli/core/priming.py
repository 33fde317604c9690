"""Priming a stream with its persona, as NVIDIA's `LMGen.step_system_prompts` does it.

Phases, every token forced (sampling during priming only draws randomness, so the
depformer's chain, whose samples nobody would read, is skipped):
  voice prompt   Mimi codes of the voice recording as the assistant's audio (or the stored
                 input embeddings of a .pt voice), text PAD, the caller hears a sine tone;
  silence        6 frames of the assistant's silence codes, text PAD;
  role prompt    the `<system> ... <system>` tokens, one per frame, assistant silent;
  silence        6 frames again.
`steps` runs them one generator step at a time, so a caller can spread priming over time.
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
