"""The PersonaPlex language model: a temporal transformer over 17 token streams and a depformer.

Streams: 0 = text, 1..8 = the assistant's Mimi codes, 9..16 = the caller's. Per 80 ms frame,
the temporal transformer (7B) reads the summed embeddings of one column of tokens and emits
text logits plus a context vector; the depformer then walks the audio codebooks one at a
time, each step with its own weights, fed the token chosen at the previous step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layers import CONVERSATION_WINDOW, Attention, Transformer, Window
from .streaming import StreamState


class RMSNorm(nn.Module):
    """y = x * (alpha * rsqrt(mean(x^2) + eps)), computed in fp32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-8):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(1, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        var = self.eps + torch.mean(x32 * x32, dim=-1, keepdim=True)
        return (x32 * (self.alpha.float() * torch.rsqrt(var))).to(x.dtype)


def gated_hidden(dim: int, dim_feedforward: int) -> int:
    # The reference's rule: 2/3 of the feed-forward width, or 21/8 dim when it is exactly 4 dim.
    return (21 * dim) // 8 if dim_feedforward == 4 * dim else (2 * dim_feedforward) // 3


class Gating(nn.Module):
    """SiLU-gated feed-forward: the first half of linear_in goes through SiLU, times the second."""

    def __init__(self, dim: int, dim_feedforward: int):
        super().__init__()
        hidden = gated_hidden(dim, dim_feedforward)
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_in(x).unflatten(-1, (2, -1))
        return self.linear_out(F.silu(h[..., 0, :]) * h[..., 1, :])


class LMLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, dim_feedforward: int, context: int,
                 steps: int = 1):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.self_attn = Attention(dim, num_heads, context, steps)
        self.norm2 = RMSNorm(dim)
        if steps == 1:
            self.gating = Gating(dim, dim_feedforward)
        else:
            self.gating = nn.ModuleList(Gating(dim, dim_feedforward) for _ in range(steps))

    def forward(self, x, rope, slots, mask, state, step=0):
        x = x + self.self_attn(self.norm1(x), rope, slots, mask, state, step)
        gating = self.gating if isinstance(self.gating, Gating) else self.gating[step]
        return x + gating(self.norm2(x))


class Embedding(nn.Embedding):
    """Token embedding where id -1 gives an exact zero vector (an absent stream)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y = super().forward(tokens.clamp(min=0))
        return torch.where((tokens == -1)[..., None], torch.zeros((), dtype=y.dtype,
                                                                  device=y.device), y)


def check_lm_arch(lm: dict[str, Any]) -> None:
    from .config import ArchError

    fixed = {"causal": True, "gating": "silu", "norm": "rms_norm_f32",
             "positional_embedding": "rope", "depformer_causal": True,
             "depformer_gating": "silu", "depformer_pos_emb": "none",
             "depformer_multi_linear": True, "depformer_weights_per_step": True,
             "layer_scale": None, "depformer_layer_scale": None}
    for key, want in fixed.items():
        if lm[key] != want:
            raise ArchError(f"lm.{key} = {lm[key]!r} is not supported (only {want!r})")
    if len(lm["delays"]) != lm["n_q"] + 1:
        raise ArchError("lm.delays needs one entry per stream (n_q + 1)")
    if not 1 <= lm["dep_q"] <= lm["n_q"]:
        raise ArchError("lm.dep_q must be within 1..n_q")


class LMModel(nn.Module):
    """Temporal transformer + depformer, with `dep_steps` of the checkpoint's dep_q steps built.

    Steps past `dep_steps` only predict the caller's codebooks, which are always given, so
    leaving them out changes no output token (only how much randomness sampling draws).
    """

    def __init__(self, lm: dict[str, Any], dep_steps: int | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        check_lm_arch(lm)
        # What it computes in and its KV rings hold, whatever the weights are stored as.
        self.dtype = dtype
        dim, dep_dim = lm["dim"], lm["depformer_dim"]
        self.n_q = lm["n_q"]
        self.dep_q = lm["dep_q"]
        self.dep_steps = self.dep_q if dep_steps is None else dep_steps
        if not 1 <= self.dep_steps <= self.dep_q:
            raise ValueError(f"dep_steps must be within 1..{self.dep_q}")
        self.dim = dim
        self.card = lm["card"]
        self.text_card = lm["text_card"]
        self.delays = list(lm["delays"])
        self.context = lm["context"]

        self.emb = nn.ModuleList(Embedding(self.card + 1, dim) for _ in range(self.n_q))
        self.text_emb = Embedding(self.text_card + 1, dim)
        layers = [LMLayer(dim, lm["num_heads"], int(lm["hidden_scale"] * dim), lm["context"])
                  for _ in range(lm["num_layers"])]
        self.transformer = Transformer(layers, context=lm["context"], group=1,
                                       head_dim=dim // lm["num_heads"],
                                       max_period=lm["max_period"])
        self.out_norm = RMSNorm(dim)
        self.text_linear = nn.Linear(dim, self.text_card, bias=False)

        steps = self.dep_steps
        self.depformer_in = nn.ModuleList(nn.Linear(dim, dep_dim, bias=False)
                                          for _ in range(steps))
        self.depformer_text_emb = Embedding(self.text_card + 1, dep_dim)
        self.depformer_emb = nn.ModuleList(Embedding(self.card + 1, dep_dim)
                                           for _ in range(steps - 1))
        # The reference ignores depformer_context: the KV ring holds one frame's dep_q steps.
        dep_layers = [LMLayer(dep_dim, lm["depformer_num_heads"],
                              lm["depformer_dim_feedforward"], self.dep_q, steps)
                      for _ in range(lm["depformer_num_layers"])]
        self.depformer = Transformer(dep_layers, context=self.dep_q, group=1,
                                     head_dim=dep_dim // lm["depformer_num_heads"],
                                     max_period=None)
        self.linears = nn.ModuleList(nn.Linear(dep_dim, self.card, bias=False)
                                     for _ in range(steps))
        # depformer_window's constants, by (step, slots seen, device)
        self._depformer_windows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # depformer_step and forward_embeddings as torch.compile made them, where it did
        # (model/compiled.py)
        self.depformer_compiled = None
        self.temporal_compiled = None

    @property
    def num_streams(self) -> int:
        return self.n_q + 1

    def initial_tokens(self) -> list[int]:
        """The start-of-stream token of each stream (the embedding tables' last rows)."""
        return [self.text_card] + [self.card] * self.n_q

    def temporal_state(self, batch: int = 1, window: Window = CONVERSATION_WINDOW,
                       trim: bool = False) -> StreamState:
        return StreamState.create(self.transformer, batch, dtype=self.dtype, window=window,
                                  trim=trim)

    def depformer_state(self, batch: int = 1, window: Window = CONVERSATION_WINDOW,
                        trim: bool = False) -> StreamState:
        return StreamState.create(self.depformer, batch, dtype=self.dtype, window=window,
                                  trim=trim)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, 17] -> summed input embedding [B, 1, dim], audio 0..n_q-1 then text."""
        x = self.emb[0](tokens[:, 1])
        for k in range(1, self.n_q):
            x = x + self.emb[k](tokens[:, k + 1])
        return (x + self.text_emb(tokens[:, 0]))[:, None]

    def forward_embeddings(self, x: torch.Tensor, state: StreamState
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, 1, dim] -> (context [B, 1, dim] after out_norm, text logits [B, text_card])."""
        out = self.out_norm(self.transformer(x, state))
        return out, self.text_linear(out)[:, 0]

    def temporal_runner(self):
        """What runs a temporal step: forward_embeddings, or its compiled form."""
        return self.temporal_compiled or self.forward_embeddings

    # -- the depformer ----------------------------------------------------------------------

    def fuse_depformer_inputs(self) -> None:
        """Once loaded: the steps' input projections made one matrix [steps x dep_dim, dim],
        each step's weight a view of its rows (no second copy), so a frame projects the
        context for every step in one product (depformer_inputs)."""
        fused = torch.cat([linear.weight.detach() for linear in self.depformer_in])
        rows = fused.shape[0] // len(self.depformer_in)
        for step, linear in enumerate(self.depformer_in):
            linear.weight = nn.Parameter(fused[step * rows:(step + 1) * rows],
                                         requires_grad=False)
        self.register_buffer("depformer_in_fused", fused, persistent=False)

    def depformer_inputs(self, context: torch.Tensor) -> torch.Tensor:
        """context [B, 1, dim] -> every step's input projection [B, steps, 1, dep_dim]: one
        product over the fused weight (CPU: bit for bit the steps' own products; tests/
        test_depformer.py), or one per step before fuse_depformer_inputs."""
        fused = getattr(self, "depformer_in_fused", None)
        if fused is None:
            return torch.stack([linear(context) for linear in self.depformer_in], dim=1)
        # a weight, or the product built here holding it in its tiles (tile_bf16_linears)
        projected = fused(context) if isinstance(fused, nn.Module) else F.linear(context, fused)
        return projected.view(context.shape[0], len(self.depformer_in), 1, -1)

    def depformer_window(self, step: int, state: StreamState
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring slot [1, 1] step `step` writes and the slots it sees [1, 1, 1, S], the
        same for every row and every frame (a frame starts the depformer's ring afresh, and
        dep_steps < its capacity: it never wraps), made once per device, step and S. S: the
        slots written so far where the window is trimmed (eager fp32), else the ring's
        capacity, as Transformer.forward would attend."""
        window = state[self.depformer]
        # compiled, every step sees the whole ring: one shape for all the steps
        trim = window.trim and self.depformer_compiled is None
        used = step + 1 if trim else window.capacity
        key = (step, used, window.offset.device)
        cached = self._depformer_windows.get(key)
        if cached is None:
            device = window.offset.device
            cached = (torch.full((1, 1), step, dtype=torch.long, device=device),
                      (torch.arange(used, device=device) <= step).view(1, 1, 1, used))
            self._depformer_windows[key] = cached
        return cached

    def depformer_step(self, step: int, prev_token: torch.Tensor, projected: torch.Tensor,
                       state: StreamState, slot: torch.Tensor, seen: torch.Tensor
                       ) -> torch.Tensor:
        """One depformer step: the previous token [B] (text for step 0) and this step's
        projection of the context [B, 1, dep_dim] -> logits [B, card]. `slot` and `seen`
        come from depformer_window. The layers are Transformer.forward's, without its
        per-step position bookkeeping (the depformer has no positional encoding); what
        torch.compile compiles (model/compiled.py)."""
        if step == 0:
            x = projected + self.depformer_text_emb(prev_token)[:, None]
        else:
            x = projected + self.depformer_emb[step - 1](prev_token)[:, None]
        seen = seen.expand(x.shape[0], -1, -1, -1)
        for layer in self.depformer.layers:
            x = layer(x, None, slot, seen, state, step)
        return self.linears[step](x)[:, 0]

    def depformer_draw(self, step: int, prev_token: torch.Tensor, projected: torch.Tensor,
                       state: StreamState, slot: torch.Tensor, seen: torch.Tensor, choice,
                       noise: torch.Tensor, forced: torch.Tensor, target: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """depformer_step and the draw of its token: `choice` (core.sampling.RowChoice)
        races the logits against the step's noise (noise [B, dep_steps, W]) -> (logits
        [B, card], the token drawn [B], the token the next step reads [B]: the step's
        target where it is forced (forced and target [B, dep_steps])). What --compile
        compiles, one function per step (model/compiled.py), so the draw's dozen small
        operations run inside the step's C++; the frame's tensors are passed whole, and
        each step takes its own column inside, because compiled code reads its inputs with
        the strides it was traced with."""
        logits = self.depformer_step(step, prev_token, projected, state, slot, seen)
        token = choice.sample(logits, noise[:, step])
        return logits, token, torch.where(forced[:, step], target[:, step], token)

    def depformer_runner(self):
        """What runs a depformer step and its draw: depformer_draw, or its compiled form."""
        return self.depformer_compiled or self.depformer_draw

    def depformer_logits(self, step: int, prev_token: torch.Tensor, context: torch.Tensor,
                         state: StreamState) -> torch.Tensor:
        """One depformer step from the context [B, 1, dim]: prev_token [B] (text for step 0)
        -> logits [B, card]. The frame generator projects the context once per frame
        instead (depformer_inputs)."""
        return self.depformer_step(step, prev_token, self.depformer_in[step](context), state,
                                   *self.depformer_window(step, state))
