"""Priming the generator with the persona, as NVIDIA's `LMGen.step_system_prompts` does it.

Phases, every token forced (sampling during priming only draws randomness):
  voice prompt   Mimi codes of the voice recording as the assistant's audio (or the stored
                 input embeddings of a .pt voice), text PAD, the caller hears a sine tone;
  silence        6 frames of the assistant's silence codes, text PAD;
  role prompt    the `<system> ... <system>` tokens, one per frame, assistant silent;
  silence        6 frames again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .generator import FrameGenerator

# Mimi codes of an 80 ms silent frame and of a 440 Hz sine frame (NVIDIA's constants).
SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)
TEXT_PAD = 3
TEXT_EPAD = 0
SILENCE_FRAMES = 6  # int(0.5 s * 12.5 Hz)


@dataclass
class VoiceEmbeddings:
    """A .pt voice: per-frame summed input embeddings [E, 1, 1, dim] and the token ring
    [1, 17, 4] at the end of the voice phase."""

    embeddings: torch.Tensor
    cache: torch.Tensor


def _frame(tokens: tuple[int, ...], gen: FrameGenerator) -> torch.Tensor:
    return torch.tensor(tokens, device=gen.device).expand(gen.batch, -1)


def prime_voice_codes(gen: FrameGenerator, codes: torch.Tensor,
                      record: bool = False) -> VoiceEmbeddings | None:
    """Voice phase from Mimi codes [8, N]. With `record`, returns what a .pt voice stores:
    the input embedding of every step that ran (the first frame runs none)."""
    sine = _frame(SINE_TOKENS, gen)
    embeddings = []
    for t in range(codes.shape[1]):
        gen.step(user=sine, agent=codes[:, t].to(gen.device).expand(gen.batch, -1),
                 text=TEXT_PAD)
        if record and gen.last_embedding is not None:
            embeddings.append(gen.last_embedding.cpu())
    if record:
        return VoiceEmbeddings(torch.stack(embeddings), gen.cache.cpu())
    return None


def prime_voice_embeddings(gen: FrameGenerator, voice: VoiceEmbeddings) -> None:
    for embedding in voice.embeddings:
        gen.step_embedding(embedding.expand(gen.batch, -1, -1))
    gen.cache.copy_(voice.cache.to(gen.device).expand_as(gen.cache))


def prime_silence(gen: FrameGenerator, frames: int = SILENCE_FRAMES) -> None:
    sine, silence = _frame(SINE_TOKENS, gen), _frame(SILENCE_TOKENS, gen)
    for _ in range(frames):
        gen.step(user=sine, agent=silence, text=TEXT_PAD)


def prime_text(gen: FrameGenerator, tokens: list[int]) -> None:
    sine, silence = _frame(SINE_TOKENS, gen), _frame(SILENCE_TOKENS, gen)
    for token in tokens:
        gen.step(user=sine, agent=silence, text=token)


def prime(gen: FrameGenerator, *, voice_codes: torch.Tensor | None = None,
          voice: VoiceEmbeddings | None = None, text_tokens: list[int] | None = None,
          silence_frames: int = SILENCE_FRAMES) -> None:
    """All four phases. No voice at all is allowed (the phase is skipped)."""
    if voice is not None:
        prime_voice_embeddings(gen, voice)
    elif voice_codes is not None:
        prime_voice_codes(gen, voice_codes)
    prime_silence(gen, silence_frames)
    if text_tokens:
        prime_text(gen, text_tokens)
    prime_silence(gen, silence_frames)
