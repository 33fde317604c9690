"""Token sampling as the reference does it: temperature, top-k, then an exponential race,
with every row of a batch sampling by its own parameters and its own random generator.

The race: softmax(logits / temp), the top k probabilities in descending order (not
renormalised), then argmax(p / E) with E ~ Exp(1) drawn per candidate: a multinomial draw
without a host sync. Greedy (or temp <= 0) is the argmax of the raw logits, first index on
ties, and draws nothing. The noise does not depend on the logits, so each frame's draws are
made up front (`RowSampling.draw`), row by row from the row's generator in the order the
reference consumes them (text, then each depformer step); the sampling itself then is pure
tensor work that a CUDA graph can hold, and a row's draws never depend on its batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Sampling  # noqa: F401  (its home is config.py: the CLI reads its defaults)


def make_rng(device: torch.device, seed: int | None = None) -> torch.Generator:
    """A generator on the model's device: seeded, the whole run repeats exactly; unseeded,
    fresh entropy. The global RNG is never used."""
    rng = torch.Generator(device=device)
    if seed is None:
        rng.seed()
    else:
        rng.manual_seed(seed)
    return rng


def sample_rows(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                greedy: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (cast to fp32) -> tokens [B], row b by temp[b], top_k[b] (0: all V)
    and greedy[b], racing noise[b, :k] (noise [B, K]; K = V when a row takes all)."""
    logits = logits.float()
    vocab, width = logits.shape[-1], noise.shape[-1]
    temp = torch.where(greedy, torch.ones_like(temp), temp)  # greedy rows: no 0 division
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    candidates, ids = torch.topk(probs, width, dim=-1)
    take_all = top_k == 0
    if width == vocab:  # rows without top-k race the tokens in vocabulary order
        candidates = torch.where(take_all[:, None], probs, candidates)
        ids = torch.where(take_all[:, None], torch.arange(vocab, device=ids.device), ids)
    count = torch.where(take_all, vocab, top_k)
    keep = torch.arange(width, device=ids.device) < count[:, None]
    scores = torch.where(keep, candidates / noise, -1.0)
    choice = scores.argmax(dim=-1, keepdim=True)
    sampled = ids.gather(-1, choice)[:, 0]
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


class RowSampling:
    """The sampling parameters of B rows as device tensors, their generators, and each
    frame's noise.

    `widths` fixes the noise buffers' widths (text, audio), as a CUDA graph needs; then a
    row's top-k may not exceed them. Without it the widths follow the rows' top-k.
    """

    def __init__(self, batch: int, device: torch.device, vocab: tuple[int, int],
                 dep_steps: int, widths: tuple[int, int] | None = None):
        self.batch, self.device, self.vocab, self.dep_steps = batch, device, vocab, dep_steps
        self.fixed = widths
        self.temp = [torch.ones(batch, device=device) for _ in range(2)]  # text, audio
        self.top_k = [torch.ones(batch, dtype=torch.long, device=device) for _ in range(2)]
        self.greedy = [torch.ones(batch, dtype=torch.bool, device=device) for _ in range(2)]
        self.rows: list[Sampling | None] = [None] * batch  # None: a free row, drawing nothing
        self.rngs: list[torch.Generator | None] = [None] * batch
        self.noise = self._buffers(widths or (1, 1))

    def _buffers(self, widths: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.ones(self.batch, widths[0], device=self.device),
                torch.ones(self.batch, self.dep_steps, widths[1], device=self.device))

    def check(self, sampling: Sampling) -> None:
        """Raises ValueError for a top-k wider than this engine's fixed noise widths."""
        for kind, top_k in enumerate((sampling.top_k_text, sampling.top_k_audio)):
            if self.fixed and self.width(top_k, kind) > self.fixed[kind]:
                raise ValueError(f"{('text', 'audio')[kind]} top-k {top_k or 'all'} is over "
                                 f"this engine's limit of {self.fixed[kind]}")

    def set(self, row: int, sampling: Sampling | None,
            rng: torch.Generator | None = None) -> None:
        """Row `row` samples by `sampling` from `rng` (None: a free row)."""
        if sampling is not None:
            self.check(sampling)
        self.rows[row], self.rngs[row] = sampling, rng
        if sampling is None:
            sampling = Sampling(greedy=True, top_k_text=1, top_k_audio=1)
        params = ((sampling.temp_text, sampling.top_k_text),
                  (sampling.temp_audio, sampling.top_k_audio))
        for kind, (temp, top_k) in enumerate(params):
            self.temp[kind][row] = temp
            self.top_k[kind][row] = min(top_k, self.vocab[kind])
            self.greedy[kind][row] = sampling.greedy or temp <= 0

    def width(self, top_k: int, kind: int) -> int:
        return self.vocab[kind] if top_k == 0 else min(top_k, self.vocab[kind])

    def draws(self, sampling: Sampling) -> list[tuple[int, int]]:
        """What one frame draws for a row of `sampling`: (kind, count) in order."""
        out = []
        for kind, (temp, top_k) in enumerate(((sampling.temp_text, sampling.top_k_text),
                                              (sampling.temp_audio, sampling.top_k_audio))):
            if not (sampling.greedy or temp <= 0):
                out += [(kind, self.width(top_k, kind))] * (1 if kind == 0 else self.dep_steps)
        return out

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This frame's noise, [B, K_text] and [B, dep_steps, K_audio]."""
        if not self.fixed:
            widths = [max([1] + [self.width(s.top_k_audio if kind else s.top_k_text, kind)
                                 for s in self.rows if s is not None]) for kind in (0, 1)]
            if (widths[0], widths[1]) != (self.noise[0].shape[1], self.noise[1].shape[2]):
                self.noise = self._buffers((widths[0], widths[1]))
        text, audio = self.noise
        for row, (sampling, rng) in enumerate(zip(self.rows, self.rngs)):
            if sampling is None:
                continue
            step = 0
            for kind, count in self.draws(sampling):
                target = text[row] if kind == 0 else audio[row, step]
                target[:count].exponential_(1, generator=rng)
                step += kind
        return text, audio


class FirstRows:
    """The first `rows` rows of a RowSampling, for a step of those rows alone: the same
    parameter tensors (views), and each frame's noise drawn by the whole, whose free rows
    draw nothing."""

    def __init__(self, whole: RowSampling, rows: int):
        self.whole, self.rows = whole, rows
        self.temp = [t[:rows] for t in whole.temp]
        self.top_k = [t[:rows] for t in whole.top_k]
        self.greedy = [t[:rows] for t in whole.greedy]

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        text, audio = self.whole.draw()
        return text[:self.rows], audio[:self.rows]


def advance_rng(rng: torch.Generator, frames: int, draws: list[tuple[int, int]]) -> None:
    """Moves `rng` on as `frames` frames of `draws` (RowSampling.draws) would."""
    if not draws or frames <= 0:
        return
    scratch = torch.empty(max(count for _, count in draws), device=rng.device)
    for _ in range(frames):
        for _, count in draws:
            scratch[:count].exponential_(1, generator=rng)
