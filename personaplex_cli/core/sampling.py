"""Token sampling as the reference does it: temperature, top-k, then an exponential race."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Sampling:
    temp_text: float = 0.7
    top_k_text: int = 25
    temp_audio: float = 0.8
    top_k_audio: int = 250
    greedy: bool = False


def sample_token(logits: torch.Tensor, temp: float, top_k: int, greedy: bool,
                 rngs: Sequence[torch.Generator] | torch.Generator | None) -> torch.Tensor:
    """logits [B, V] (cast to fp32) -> tokens [B].

    softmax(logits / temp), the top k probabilities (not renormalised), then
    argmax(p / E) with E ~ Exp(1): a multinomial draw without a host sync. Row b draws its
    noise from rngs[b] alone, so a stream's samples never depend on its batch mates. Greedy
    (or temp <= 0) is the argmax of the raw logits, first index on ties.
    """
    logits = logits.float()
    if greedy or temp <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temp, dim=-1)
    if top_k > 0:
        probs, ids = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1)
    noise = torch.empty_like(probs)
    if rngs is None or isinstance(rngs, torch.Generator):
        noise.exponential_(1, generator=rngs)
    else:
        for row, rng in zip(noise, rngs, strict=True):
            row.exponential_(1, generator=rng)
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    return (ids.gather(-1, choice) if top_k > 0 else choice)[:, 0]


def make_rng(device: torch.device, seed: int | None = None) -> torch.Generator:
    """A generator on the model's device: seeded, the whole run repeats exactly; unseeded,
    fresh entropy. The global RNG is never used."""
    rng = torch.Generator(device=device)
    if seed is None:
        rng.seed()
    else:
        rng.manual_seed(seed)
    return rng
