"""The frame generator: one column of tokens in, one un-delayed frame of 17 tokens out.

Bookkeeping follows NVIDIA's PersonaPlex `LMGen` exactly (reference-personaplex.md section 3.4):
a ring of CT = max_delay + 3 token columns plus a `provided` mask. Tokens given for frame t
(forced text, assistant codes, the caller's codes) are written at column (t + delay) and win
over sampled ones, also inside the depformer chain. The model runs on column t-1 and fills
column t; offset 0 runs nothing. Once past max_delay, each step returns frame t-1 whole:
[text, assistant codes 1..8, caller codes 9..16].
"""

from __future__ import annotations

import torch

from typing import Sequence

from .lm import LMModel
from .sampling import Sampling, make_rng, sample_token

UNGENERATED = -2  # a ring slot nothing was written to yet; never fed to the model


def rng_per_stream(generator: torch.Generator | Sequence[torch.Generator] | None, batch: int,
                   device: torch.device) -> list[torch.Generator]:
    """One random generator per stream: the one given (batch 1), the list given, or fresh
    entropy for each."""
    if generator is None:
        return [make_rng(device) for _ in range(batch)]
    rngs = [generator] if isinstance(generator, torch.Generator) else list(generator)
    if len(rngs) != batch:
        raise ValueError(f"{len(rngs)} random generators for {batch} streams")
    return rngs


class FrameGenerator:
    def __init__(self, lm: LMModel, sampling: Sampling = Sampling(), *,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None,
                 window: str = "nvidia", batch: int = 1):
        self.lm = lm
        self.sampling = sampling
        self.device = next(lm.parameters()).device
        self.batch = batch
        self.rngs = rng_per_stream(generator, batch, self.device)
        self.delays = torch.tensor(lm.delays, device=self.device)
        self.max_delay = max(lm.delays)
        self.ring = self.max_delay + 3
        streams = lm.num_streams
        self.cache = torch.full((batch, streams, self.ring), UNGENERATED, dtype=torch.long,
                                device=self.device)
        self.provided = torch.zeros((batch, streams, self.ring), dtype=torch.bool,
                                    device=self.device)
        self.initial = torch.tensor(lm.initial_tokens(), device=self.device)
        self.offset = 0
        self.last_embedding: torch.Tensor | None = None  # input of the last step that ran
        self.temporal = lm.temporal_state(batch, window)
        self.depth = lm.depformer_state(batch, window)
        n_agent = lm.n_q // 2
        self.agent_rows = torch.arange(1, 1 + n_agent, device=self.device)
        self.user_rows = torch.arange(1 + n_agent, lm.num_streams, device=self.device)

    def reset(self) -> None:
        """A new conversation. Like the reference, stale ring columns stay: none is read."""
        self.offset = 0
        self.provided.fill_(False)
        self.temporal.reset()

    # -- one frame --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, user: torch.Tensor | None = None, agent: torch.Tensor | None = None,
             text: torch.Tensor | int | None = None) -> torch.Tensor | None:
        """Feeds frame `offset`: caller codes user [B, 8], forced assistant codes agent [B, 8]
        and forced text [B] (each optional). Returns frame offset-1 [B, 17], or None early on.
        """
        if user is None and self.lm.dep_steps < self.lm.dep_q:
            raise ValueError("the caller's codes must be given when the depformer skips "
                             "their steps")
        self.last_embedding = None
        prepared = self._prepare(user, agent, text)
        if prepared is None:
            return None
        tokens, target, forced, input_col, target_col = prepared
        self.last_embedding = self.lm.embed(tokens)
        return self._run(self.last_embedding, target, forced, input_col, target_col)

    @torch.inference_mode()
    def step_embedding(self, embedding: torch.Tensor) -> torch.Tensor | None:
        """Replays a stored input embedding [B, 1, dim] (a .pt voice prompt) for one frame."""
        dummy = self.initial.expand(self.batch, -1)
        while True:  # as NVIDIA's replay: initial audio and text PAD (3) forced, all overwritten
            prepared = self._prepare(dummy[:, self.user_rows], dummy[:, self.agent_rows], 3)
            if prepared is not None:
                break
        _, target, forced, input_col, target_col = prepared
        return self._run(embedding.to(self.device), target, forced, input_col, target_col)

    # -- internals ---------------------------------------------------------------------------

    def _force(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        columns = (self.offset + self.delays[rows]) % self.ring
        self.cache[:, rows, columns] = tokens.to(self.device, torch.long)
        self.provided[:, rows, columns] = True

    def _prepare(self, user, agent, text):
        if user is not None:
            self._force(self.user_rows, user)
        if agent is not None:
            self._force(self.agent_rows, agent)
        if text is not None:
            text = torch.as_tensor(text, device=self.device).expand(self.batch)
            self._force(torch.zeros(1, dtype=torch.long, device=self.device), text[:, None])
        col = self.offset % self.ring
        for k, delay in enumerate(self.lm.delays):
            # Delayed streams have nothing to show at first: they start from the initial token.
            if self.offset <= delay:
                self.cache[:, k, col] = self.initial[k]
                self.provided[:, k, col] = True
        if self.offset == 0:
            self.cache[:, :, 0] = self.initial
            self.offset = 1
            return None
        input_col = (self.offset - 1) % self.ring
        target_col = self.offset % self.ring
        return (self.cache[:, :, input_col].clone(), self.cache[:, :, target_col].clone(),
                self.provided[:, :, target_col].clone(), input_col, target_col)

    def _run(self, x: torch.Tensor, target: torch.Tensor, forced: torch.Tensor,
             input_col: int, target_col: int) -> torch.Tensor | None:
        context, text_logits = self._temporal(x)
        text, audio = self._sample(context, text_logits, target, forced)
        self.provided[:, :, input_col] = False

        col = target_col
        self.cache[:, 0, col] = torch.where(self.provided[:, 0, col], self.cache[:, 0, col], text)
        rows = slice(1, 1 + audio.shape[1])
        self.cache[:, rows, col] = torch.where(self.provided[:, rows, col],
                                               self.cache[:, rows, col], audio)
        if self.offset <= self.max_delay:
            self.offset += 1
            return None
        columns = (self.offset - self.max_delay + self.delays) % self.ring
        frame = self.cache[:, torch.arange(len(self.delays), device=self.device), columns]
        self.offset += 1
        return frame

    def _temporal(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, 1, dim] -> (context [B, 1, dim], text logits [B, text_card])."""
        return self.lm.forward_embeddings(x, self.temporal)

    def _sample(self, context: torch.Tensor, text_logits: torch.Tensor, target: torch.Tensor,
                forced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> sampled text [B] and audio [B, dep_steps]; forced tokens steer the chain."""
        s = self.sampling
        text = sample_token(text_logits, s.temp_text, s.top_k_text, s.greedy, self.rngs)
        chosen_text = torch.where(forced[:, 0], target[:, 0], text)
        return text, self._depformer(chosen_text, context, target[:, 1:], forced[:, 1:])

    def _depformer(self, text: torch.Tensor, context: torch.Tensor, targets: torch.Tensor,
                   forced: torch.Tensor) -> torch.Tensor:
        """Samples the audio codebooks one by one -> [B, dep_steps] (sampled values)."""
        s = self.sampling
        self.depth.reset()
        prev = text
        sampled = []
        for k in range(self.lm.dep_steps):
            logits = self.lm.depformer_logits(k, prev, context, self.depth)
            token = sample_token(logits, s.temp_audio, s.top_k_audio, s.greedy, self.rngs)
            prev = torch.where(forced[:, k], targets[:, k], token)
            sampled.append(token)
        return torch.stack(sampled, dim=1)
