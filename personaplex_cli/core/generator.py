"""The frame generator: one column of tokens in, one un-delayed frame of 17 tokens out, for
B streams that each live at their own frame offset.

Bookkeeping follows NVIDIA's PersonaPlex `LMGen` exactly (reference-personaplex.md section 3.4),
per row: a ring of CT = max_delay + 3 token columns plus a `provided` mask. Tokens given for
frame t (forced text, assistant codes, the caller's codes) are written at column (t + delay)
and win over sampled ones, also inside the depformer chain. The model runs on column t-1 and
fills column t; offset 0 runs nothing. Once past max_delay, each step returns frame t-1 whole:
[text, assistant codes 1..8, caller codes 9..16].

Rows are independent streams: `reset(rows)` starts some afresh, `save(row)` / `restore(row)`
move one stream's whole state (a primed persona) into another row or another generator.
Every row takes part in every step (a captured graph has one shape); a row nobody uses just
computes something nobody reads.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from .config import TEXT_PAD
from .layers import CONVERSATION_WINDOW, Window
from .lm import LMModel
from .sampling import FirstRows, Noise, RowChoice, RowSampling, Sampling
from .streaming import Rows, host_rows, row_index

UNGENERATED = -2  # a ring slot nothing was written to yet; never fed to the model


class FrameGenerator:
    def __init__(self, lm: LMModel, batch: int = 1, *, window: Window = CONVERSATION_WINDOW,
                 trim: bool = False, noise_widths: tuple[int, int] | None = None):
        self.lm = lm
        self.device = next(lm.parameters()).device
        self.batch = batch
        self.delays = torch.tensor(lm.delays, device=self.device)
        self.max_delay = max(lm.delays)
        self.ring = self.max_delay + 3
        streams = lm.num_streams
        self.cache = torch.full((batch, streams, self.ring), UNGENERATED, dtype=torch.long,
                                device=self.device)
        self.provided = torch.zeros((batch, streams, self.ring), dtype=torch.bool,
                                    device=self.device)
        self.initial = torch.tensor(lm.initial_tokens(), device=self.device)
        self.offsets = np.zeros(batch, np.int64)  # each row's frame offset (host)
        self.offset = torch.zeros(batch, dtype=torch.long, device=self.device)  # the same
        self.last_embedding: torch.Tensor | None = None  # input of the last step that ran
        # The last step's own tokens [B, 1 + dep_steps] (text, then the audio codebooks it
        # ran) before any forced token overrode them, or None (doctor's agreement check
        # compares these; with graphs, the graph's buffer, overwritten by the next step).
        self.predicted: torch.Tensor | None = None
        self.temporal = lm.temporal_state(batch, window, trim)
        self.depth = lm.depformer_state(batch, window, trim)
        self.sampling = RowSampling(batch, self.device, (lm.text_card, lm.card), lm.dep_steps,
                                    noise_widths)
        n_agent = lm.n_q // 2
        self.agent_rows = torch.arange(1, 1 + n_agent, device=self.device)
        self.user_rows = torch.arange(1 + n_agent, lm.num_streams, device=self.device)
        self.text_row = torch.zeros(1, dtype=torch.long, device=self.device)
        self._rows = torch.arange(batch, device=self.device)

    # -- rows --------------------------------------------------------------------------------

    def set_sampling(self, row: int, sampling: Sampling | None, rng: Noise | None = None
                     ) -> None:
        """Row `row` samples by `sampling` (None: a free row) with its own noise, `rng`: a
        key or a generator (sampling.py)."""
        self.sampling.set(row, sampling, rng)

    def reset(self, rows: Rows = None) -> None:
        """Those rows (default: all) start a new stream. Like the reference, stale ring
        columns stay: none is read."""
        self.offsets[host_rows(rows)] = 0
        index = row_index(rows, self.device)
        self.offset[index] = 0
        self.provided[index] = False
        self.temporal.reset(rows)

    def save(self, row: int) -> tuple:
        """One stream's whole state (the depformer's is rebuilt every frame)."""
        return (int(self.offsets[row]), self.cache[row].clone(), self.provided[row].clone(),
                self.temporal.save(row))

    def restore(self, row: int, saved: tuple) -> None:
        offset, cache, provided, temporal = saved
        self.offsets[row] = offset
        self.offset[row] = offset
        self.cache[row] = cache
        self.provided[row] = provided
        self.temporal.restore(row, temporal)

    def rows_for(self, rows: int) -> int:
        """How many rows a step of the first `rows` computes: those (a graphed generator
        replays the smallest batch it captured that covers them)."""
        return rows

    def first_rows(self, rows: int) -> FrameGenerator:
        """A generator of this one's first `rows` rows, sharing its memory: a step of it
        costs those rows alone and moves them on in place (rows are independent streams,
        so the others lose nothing but a step they would have thrown away)."""
        view = copy.copy(self)
        view.batch = rows
        view.cache, view.provided = self.cache[:rows], self.provided[:rows]
        view.offsets, view.offset = self.offsets[:rows], self.offset[:rows]
        view.temporal, view.depth = self.temporal.prefix(rows), self.depth.prefix(rows)
        view.sampling = FirstRows(self.sampling, rows)
        view._rows = self._rows[:rows]
        return view

    # -- one frame --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, user: torch.Tensor | None = None, agent: torch.Tensor | None = None,
             text: torch.Tensor | int | None = None, *, depformer: bool = True
             ) -> torch.Tensor | None:
        """Feeds each row's frame `offset`: caller codes user [B, 8], forced assistant codes
        agent [B, 8] and forced text [B] (each optional). Returns frame offset-1 [B, 17]
        (rows still within the first max_delay frames hold nothing yet), or None while no
        row has a frame. `depformer=False` skips the audio codebooks' chain: only for steps
        whose every token is forced (priming), where its samples are never used.
        """
        if user is None and self.lm.dep_steps < self.lm.dep_q:
            raise ValueError("the caller's codes must be given when the depformer skips "
                             "their steps")
        self.last_embedding = None
        prepared = self._prepare(user, agent, text)
        if prepared is None:
            return None
        self.last_embedding = self.lm.embed(prepared[0])
        return self._run(self.last_embedding, *prepared[1:], depformer=depformer)

    @torch.inference_mode()
    def step_embedding(self, embedding: torch.Tensor) -> torch.Tensor | None:
        """Replays a stored input embedding [B, 1, dim] (a .pt voice prompt) for one frame."""
        dummy = self.initial.expand(self.batch, -1)
        while True:  # as NVIDIA's replay: initial audio and PAD forced, all overwritten
            prepared = self._prepare(dummy[:, self.user_rows], dummy[:, self.agent_rows],
                                     TEXT_PAD)
            if prepared is not None:
                break
        return self._run(embedding.to(self.device), *prepared[1:], depformer=False)

    # -- priming several rows at once (core/priming.Primer) -----------------------------------

    @torch.inference_mode()
    def open_row(self, row: int, user: torch.Tensor, agent: torch.Tensor, text: int) -> None:
        """Frame 0 of a fresh stream in `row` alone: its forced tokens (user and agent
        [8]) written and the row moved to offset 1. Frame 0 runs no model, so this touches
        no other row; a fresh row stepped with others would run at once instead."""
        if self.offsets[row] != 0:
            raise ValueError(f"row {row} is not fresh")
        view = copy.copy(self)
        view.batch = 1
        view.cache, view.provided = self.cache[row:row + 1], self.provided[row:row + 1]
        view.offsets, view.offset = self.offsets[row:row + 1], self.offset[row:row + 1]
        view._rows = self._rows[:1]
        view._prepare(user[None], agent[None], text)

    @torch.inference_mode()
    def step_forced(self, user: torch.Tensor, agent: torch.Tensor, text: torch.Tensor,
                    stored: torch.Tensor | None = None, embedding: torch.Tensor | None = None
                    ) -> None:
        """One priming step of every row, every token forced (user and agent [B, 8], text
        [B]) and the depformer's chain skipped (its samples would be thrown away). Rows
        where `stored` [B] holds replay embedding [B, 1, dim] (a .pt voice) instead of their
        tokens' embedding, as `step_embedding` does. Open a stream's row first (open_row):
        a row still fresh here runs as no stream alone would (a spare row may)."""
        prepared = self._prepare(user, agent, text)
        if prepared is None:
            raise ValueError("open a stream's row before stepping it")
        x = self.lm.embed(prepared[0])
        if stored is not None:
            x = torch.where(stored.to(self.device)[:, None, None],
                            embedding.to(self.device, x.dtype), x)
        self._run(x, *prepared[1:], depformer=False)

    # -- internals ---------------------------------------------------------------------------

    def _columns(self, rows: torch.Tensor, shift: int = 0) -> torch.Tensor:
        """Each row's ring column for frame offset + shift of streams `rows` -> [B, len]."""
        return (self.offset[:, None] + shift + self.delays[rows][None, :]) % self.ring

    def _force(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        columns = self._columns(rows)
        self.cache[self._rows[:, None], rows[None, :], columns] = tokens.to(self.device,
                                                                             torch.long)
        self.provided[self._rows[:, None], rows[None, :], columns] = True

    def _column(self, tensor: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """tensor [B, S, ring] at each row's column [B] -> [B, S]."""
        index = column[:, None, None].expand(-1, tensor.shape[1], 1)
        return tensor.gather(2, index)[:, :, 0]

    def _prepare(self, user, agent, text):
        if user is not None:
            self._force(self.user_rows, user)
        if agent is not None:
            self._force(self.agent_rows, agent)
        if text is not None:
            text = torch.as_tensor(text, device=self.device).expand(self.batch)
            self._force(self.text_row, text[:, None])
        column = self.offset % self.ring
        if (self.offsets <= self.max_delay).any():
            # Delayed streams have nothing to show at first: they start from the initial token.
            starting = self.offset[:, None] <= self.delays[None, :]  # [B, S]
            index = column[:, None, None].expand(-1, self.lm.num_streams, 1)
            initial = self.initial.expand(self.batch, -1)[:, :, None]
            now = self.cache.gather(2, index)
            self.cache.scatter_(2, index, torch.where(starting[:, :, None], initial, now))
            self.provided.scatter_(2, index, self.provided.gather(2, index) |
                                   starting[:, :, None])
        fresh = self.offsets == 0
        if fresh.any():
            rows = torch.from_numpy(np.flatnonzero(fresh)).to(self.device)
            self.cache[rows, :, 0] = self.initial
            self.offsets[fresh] = 1
            self.offset[rows] = 1
            if fresh.all():
                return None
        input_col = (self.offset - 1) % self.ring
        target_col = self.offset % self.ring
        return (self._column(self.cache, input_col), self._column(self.cache, target_col),
                self._column(self.provided, target_col), input_col, target_col)

    def _run(self, x: torch.Tensor, target: torch.Tensor, forced: torch.Tensor,
             input_col: torch.Tensor, target_col: torch.Tensor, *, depformer: bool
             ) -> torch.Tensor | None:
        # Drawn even when unused: a generator moves on alike (a key's noise follows the offset).
        noise = self.sampling.draw_generators()
        context, text_logits = self._temporal(x)
        self.predicted = None
        if depformer:
            sampled = self.predicted = self._sample(context, text_logits, target, forced,
                                                    *noise)
            width = sampled.shape[1]
            target = target.clone()
            target[:, :width] = torch.where(forced[:, :width], target[:, :width], sampled)
        self.provided.scatter_(2, input_col[:, None, None].expand(-1, self.lm.num_streams, 1),
                               False)
        self.cache.scatter_(2, target_col[:, None, None].expand(-1, self.lm.num_streams, 1),
                            target[:, :, None])
        ready = self.offsets > self.max_delay
        columns = (self.offset[:, None] - self.max_delay + self.delays[None, :]) % self.ring
        frame = self.cache.gather(2, columns[:, :, None])[:, :, 0] if ready.any() else None
        self.offsets += 1
        self.offset += 1
        return frame

    def _temporal(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, 1, dim] -> (context [B, 1, dim], text logits [B, text_card])."""
        return self.lm.temporal_runner()(x, self.temporal)

    def _sample(self, context: torch.Tensor, text_logits: torch.Tensor, target: torch.Tensor,
                forced: torch.Tensor, text_noise: torch.Tensor, audio_noise: torch.Tensor
                ) -> torch.Tensor:
        """-> sampled text and audio [B, 1 + dep_steps]; forced tokens steer the chain. The
        context is projected for every depformer step at once, the rows' sampling
        parameters read once for all the codebooks, and each step's ring slot and mask are
        the LM's constants: a step runs its layers and its draw, nothing else."""
        s, lm = self.sampling, self.lm
        text_noise, audio_noise = s.with_keyed(self.offset, text_noise, audio_noise)
        text = RowChoice(s.temp[0], s.top_k[0], s.greedy[0], lm.text_card,
                         text_noise.shape[-1]).sample(text_logits, text_noise)
        sampled = [text]
        prev = torch.where(forced[:, 0], target[:, 0], text)
        audio = RowChoice(s.temp[1], s.top_k[1], s.greedy[1], lm.card, audio_noise.shape[-1])
        projected = lm.depformer_inputs(context)
        draw = lm.depformer_runner()
        forced, target = forced[:, 1:], target[:, 1:]  # the codebooks'
        for k, projected_k in enumerate(projected.unbind(1)):
            _, token, prev = draw(k, prev, projected_k, self.depth,
                                  *lm.depformer_window(k, self.depth), audio, audio_noise,
                                  forced, target)
            sampled.append(token)
        return torch.stack(sampled, dim=1)
