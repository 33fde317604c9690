"""Transformer building blocks shared by Mimi and the LM: RoPE, ring-buffer attention, norms.

The attention window, once the KV ring is full, is one parameter (`window`) of this code:
  "exact"  every query sees the last `context` steps (a whole-sequence causal window);
  "kyutai" Kyutai's moshi 0.2.13 ring: the `group` keys of one call are written into a ring of
           `context` slots before attending, so earlier queries of a call lose their oldest keys;
  "nvidia" NVIDIA's PersonaPlex fork: as "kyutai", but the oldest slot also drops out, one step
           early, once the ring has wrapped.
`group` is how many steps the reference writes per call (2 for Mimi at 25 Hz, 1 for the LM), so
a call with several frames at once gives exactly what frame-by-frame calls would.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import CODEC_WINDOW, CONVERSATION_WINDOW, WINDOWS, Window  # noqa: F401
from .streaming import Rows, StreamState, Streaming, row_index


def check_window(window: str) -> Window:
    if window not in WINDOWS:
        raise ValueError(f"unknown attention window rule {window!r}")
    return window  # type: ignore[return-value]


def rope_tables(positions: torch.Tensor, head_dim: int, max_period: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of interleaved RoPE for `positions` [B, T] -> two fp32 tensors
    [B, 1, T, head_dim/2] (the 1 broadcasts over heads)."""
    half = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(half * (-math.log(max_period) * 2 / head_dim))
    angles = positions.float()[:, None, :, None] * freqs
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates interleaved pairs (x[2i], x[2i+1]) of x [..., B, H, T, D], in fp32 like the
    reference."""
    pairs = x.unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0].float(), pairs[..., 1].float()
    out_real = real * cos - imag * sin
    out_imag = real * sin + imag * cos
    return torch.stack([out_real.to(x.dtype), out_imag.to(x.dtype)], dim=-1).flatten(-2)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, context: int, window: Window,
                group: int) -> torch.Tensor:
    """Which ring slots each query may attend to: bool [B, 1, T, S] (1: every head).

    q_pos [B, T] are the queries' absolute positions, k_pos [B, S] the positions held by the
    ring slots (-1 for never written), each row a stream of its own.
    """
    delta = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, S]
    mask = (k_pos >= 0)[:, None, :] & (delta >= 0) & (delta < context)
    if window != "exact":
        # The reference's ring holds `context` slots after each call of `group` steps.
        call_end = (torch.div(q_pos, group, rounding_mode="floor") + 1) * group
        oldest = call_end - context + (1 if window == "nvidia" else 0)
        mask &= k_pos[:, None, :] >= oldest[:, :, None]
    return mask[:, None]


@dataclass
class WindowState:
    """Positions shared by every layer of one transformer, per stream: where each row is,
    and what each of its ring slots holds.

    Everything a step reads or moves is a device tensor, so a captured CUDA graph, which
    replays no Python, keeps it right: a row's fill is its offset (steps written since its
    start, slots filling from 0 up), read back on the host only where a row is saved."""

    offset: torch.Tensor  # [B] int64, absolute position of each row's next step
    slot_pos: torch.Tensor  # [B, capacity] int64, position held by each ring slot, -1 if empty
    context: int
    window: Window
    group: int
    # Attend only over the slots written so far (they fill from slot 0 up). Eager fp32 only:
    # a captured CUDA graph needs the full, fixed-size ring, and in bf16 the attention
    # kernel's rounding depends on the key count, so exact parity needs the reference's shape.
    trim: bool = False

    @property
    def capacity(self) -> int:
        return self.slot_pos.shape[1]

    def used_slots(self, row: int) -> int:
        return int(min(int(self.offset[row]), self.capacity))

    def reset(self, rows: Rows = None) -> None:
        self.offset[row_index(rows, self.offset.device)] = 0
        self.slot_pos[row_index(rows, self.offset.device)] = -1

    def save(self, row: int, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.offset[row].clone(), self.slot_pos[row].clone()

    def restore(self, row: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        offset, slot_pos = saved
        self.offset[row] = offset
        self.slot_pos[row] = slot_pos

    def advance(self, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Claims ring slots for `steps` new steps of every row -> (positions [B, T],
        slots [B, T], mask [B, 1, T, S]), where the mask covers the first S ring slots
        (S = all of them unless trimmed)."""
        if steps > self.capacity:
            raise ValueError(f"{steps} steps do not fit a ring of {self.capacity} slots")
        positions = self.offset[:, None] + torch.arange(steps, device=self.offset.device)
        slots = positions % self.capacity
        self.slot_pos.scatter_(1, slots, positions)
        self.offset += steps
        # Trimmed (eager, on the CPU) the fill is read back: a host sync a graph never makes.
        used = (min(int(self.offset.max()), self.capacity) if self.trim and len(self.offset)
                else self.capacity)
        mask = window_mask(positions, self.slot_pos[:, :used], self.context, self.window,
                           self.group)
        return positions, slots, mask


@dataclass
class KVRing:
    keys: torch.Tensor  # [B, H, capacity, D]
    values: torch.Tensor  # [B, H, capacity, D]

    def reset(self, rows: Rows = None) -> None:
        pass  # stale slots are masked out by WindowState.slot_pos

    def save(self, row: int, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Slots fill from 0 up, so the first `used` hold the whole history.
        return self.keys[row, :, :used].clone(), self.values[row, :, :used].clone()

    def restore(self, row: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        keys, values = saved
        self.keys[row, :, :keys.shape[1]] = keys
        self.values[row, :, :values.shape[1]] = values

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H, T, D] into each row's own slots [B, T]."""
        # Indexed assignment, not scatter_: torch 2.13's CPU scatter_ in bf16 goes through an
        # fp32 copy of the whole ring, both ways (62 ms for a one-slot write into four rows
        # of a 3001-slot ring, against 0.03 ms here; fp32 0.03 ms either way).
        rows = torch.arange(k.shape[0], device=slots.device)[:, None]
        self.keys[rows, :, slots] = k.transpose(1, 2)
        self.values[rows, :, slots] = v.transpose(1, 2)

    def window(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, used, D] of the first `used` slots."""
        return self.keys[:, :, :used], self.values[:, :, :used]


# From this many ring slots on, one query on the CPU is answered faster by bag_attention's
# weighted row sums than by torch's fused kernel; below, the kernel's one call is cheaper
# than their several (16 heads of 64, bf16, 2 threads, fused against bags: 34 against 47 us
# at the depformer's 17 slots, 56 against 48 at 40, 78 against 49 at 64; 32 heads of 128:
# 88 against 67 at 17, 173 against 59 at 40; the 7B's 3001-slot window: bench/floor.py
# --attention).
BAG_ATTENTION_FROM = 32
# The most slots in one block of a BlockKVRing's keys: each block is one row of the bag
# kernel's table, and rows of 126 to 160 slots read the 7B's window at 25 to 30 GB/s on two
# threads, where whole rings as rows (3001 slots) read it at 16 to 19 (bench/floor.py
# --attention).
KEY_BLOCK_SLOTS = 128


def attends_by_bags(reference_kernel: bool, device_type: str, capacity: int) -> bool:
    """Whether one query over a ring of `capacity` slots is answered by bag_attention,
    whose ring is a BlockKVRing: for models that left the reference's rounding behind
    (quantized ones), on the CPU, over long windows."""
    return not reference_kernel and device_type == "cpu" and capacity >= BAG_ATTENTION_FROM


ATTENTION_KERNEL_NAMES = {True: "torch's embedding bag, keys by blocks",
                          False: "torch's fused kernel"}


def attention_line(root: nn.Module, device_type: str) -> str:
    """Which kernel answers one query in root's attention layers, in words: "torch's
    embedding bag, keys by blocks (32 layers); torch's fused kernel (6 layers)"."""
    counts: dict[bool, int] = {}
    for module in root.modules():
        if isinstance(module, Attention):
            bags = attends_by_bags(module.reference_kernel, device_type,
                                   ring_capacity(module.context, 1))
            counts[bags] = counts.get(bags, 0) + 1
    return "; ".join(f"{ATTENTION_KERNEL_NAMES[bags]} ({count} layers)"
                     for bags, count in sorted(counts.items(), reverse=True))


def key_blocks(capacity: int) -> tuple[int, int]:
    """(blocks, slots a block) of a BlockKVRing of `capacity` slots: as few blocks of at most
    KEY_BLOCK_SLOTS as cover it, evened out so the last pads the fewest slots."""
    blocks = -(-capacity // KEY_BLOCK_SLOTS)
    return blocks, -(-capacity // blocks)


@functools.lru_cache(maxsize=16)
def bag_rows(bags: int, bag_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's embedding_bag arguments for `bags` bags of `bag_size` consecutive table rows,
    each its own: (indices [bags * bag_size], offsets [bags]), int32 (half int64's bytes,
    which the kernel reads beside the table). The same few shapes serve every layer."""
    indices = torch.arange(bags * bag_size, dtype=torch.int32)
    return indices, indices[::bag_size].clone()


@dataclass
class BlockKVRing:
    """A KV ring laid out for bag_attention: the keys by blocks of slots, each block
    dimension-major, so one query's scores are weighted sums of a block's D rows; the values
    slot-major, so its answer is a weighted sum of the ring's slots. What it is written,
    saves and restores is KVRing's, element for element."""

    key_blocks: torch.Tensor  # [B, H, blocks, D, slots a block] (key_blocks(capacity))
    values: torch.Tensor  # [B, H, capacity, D]

    @classmethod
    def empty(cls, batch: int, heads: int, capacity: int, head_dim: int,
              device: torch.device, dtype: torch.dtype) -> "BlockKVRing":
        blocks, block = key_blocks(capacity)
        return cls(torch.zeros(batch, heads, blocks, head_dim, block, device=device,
                               dtype=dtype),
                   torch.zeros(batch, heads, capacity, head_dim, device=device, dtype=dtype))

    @property
    def capacity(self) -> int:
        return self.values.shape[2]

    def reset(self, rows: Rows = None) -> None:
        pass  # stale slots are masked out by WindowState.slot_pos

    def _key_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.key_blocks.shape[-1]
        return torch.div(slots, block, rounding_mode="floor"), slots % block

    def keys(self, used: int, row: int | None = None) -> torch.Tensor:
        """The first `used` slots' keys, slot-major [B, H, used, D] (a copy), or one row's
        [H, used, D]."""
        blocks = self.key_blocks if row is None else self.key_blocks[row]
        *lead, count, D, block = blocks.shape
        return blocks.transpose(-1, -2).reshape(*lead, count * block, D)[..., :used, :]

    def save(self, row: int, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys(used, row).contiguous(), self.values[row, :, :used].clone()

    def restore(self, row: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        keys, values = saved  # [H, used, D] each
        block, within = self._key_slots(torch.arange(keys.shape[1], device=keys.device))
        self.key_blocks[row, :, block, :, within] = keys.transpose(0, 1)
        self.values[row, :, :values.shape[1]] = values

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H, T, D] into each row's own slots [B, T]."""
        rows = torch.arange(k.shape[0], device=slots.device)[:, None]
        block, within = self._key_slots(slots)
        self.key_blocks[rows, :, block, :, within] = k.transpose(1, 2)
        self.values[rows, :, slots] = v.transpose(1, 2)

    def window(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys(used), self.values[:, :, :used]


def ring_capacity(context: int, max_steps: int) -> int:
    # Enough slots that a call of `max_steps` steps never overwrites a key one of its own
    # queries still sees, whatever the window rule.
    return context + max_steps


def stored_key_slots(capacity: int, blocks: bool) -> int:
    """Slots a ring of `capacity` stores keys for: a BlockKVRing pads its last block."""
    if not blocks:
        return capacity
    count, block = key_blocks(capacity)
    return count * block


class Attention(Streaming):
    """Multi-head self-attention with fused q|k|v rows "(p h d)" and a KV ring.

    With `steps` > 1 (the depformer) every step of a frame has its own projections.
    """

    # torch's fused attention, as the reference runs it: in bf16 its rounding is the
    # reference's. A quantized model has left that parity behind (core/quantize.py turns
    # this off), and on the CPU takes bag_attention instead (attends_by_bags).
    reference_kernel = True

    def __init__(self, dim: int, num_heads: int, context: int, steps: int = 1):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.context = context
        self.in_projs = nn.ModuleList(nn.Linear(dim, 3 * dim, bias=False) for _ in range(steps))
        self.out_projs = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(steps))

    def init_state(self, batch: int, device: torch.device, *, dtype: torch.dtype,
                   max_steps: int = 1, **_: object) -> KVRing | BlockKVRing:
        capacity = ring_capacity(self.context, max_steps)
        if attends_by_bags(self.reference_kernel, torch.device(device).type, capacity):
            return BlockKVRing.empty(batch, self.num_heads, capacity, self.head_dim, device,
                                     dtype)
        shape = (batch, self.num_heads, capacity, self.head_dim)
        return KVRing(torch.zeros(shape, device=device, dtype=dtype),
                      torch.zeros(shape, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                slots: torch.Tensor, mask: torch.Tensor, state: StreamState,
                step: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.in_projs[step](x).view(B, T, 3, self.num_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, B, H, T, D]
        if rope is not None:
            q, k = apply_rope(qkv[:2], *rope)
        else:
            q, k = qkv[0], qkv[1]
        v = qkv[2]
        ring: KVRing | BlockKVRing = state[self]
        ring.write(slots, k, v)
        out = attend(q, ring, mask)
        return self.out_projs[step](out.transpose(1, 2).reshape(B, T, C))


def attend(q: torch.Tensor, ring: KVRing | BlockKVRing, mask: torch.Tensor) -> torch.Tensor:
    """Queries q [B, H, T, D] over the first S = mask.shape[-1] slots of `ring` (mask
    [B, 1, T, S]) -> [B, H, T, D]: one query over a BlockKVRing by bag_attention, anything
    else by torch's fused kernel (over a copy of blocked keys put back in slot order)."""
    if q.shape[2] == 1 and isinstance(ring, BlockKVRing):
        return bag_attention(q, ring, mask)
    if q.shape[2] == 1 and mask.shape[-1] < BAG_ATTENTION_FROM and torch.compiler.is_compiling():
        return short_attention(q, *ring.window(mask.shape[-1]), mask)
    return F.scaled_dot_product_attention(q, *ring.window(mask.shape[-1]), attn_mask=mask)


def short_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """One query q [B, H, 1, D] over S slots (keys and values [B, H, S, D], mask [B, 1, 1, S]
    as scaled_dot_product_attention takes it, S a few) -> [B, H, 1, D], in fp32: sums and
    a softmax that compiled code fuses into one loop, for the depformer's 48 attentions a
    frame, where torch's fused kernel took 60 to 70 us a call in a compiled frame (its
    buffers and threads) for 17 slots."""
    scale = q.shape[-1] ** -0.5
    scores = (q.float() * keys.float()).sum(dim=-1, keepdim=True) * scale  # [B, H, S, 1]
    seen = mask.transpose(-1, -2)  # [B, 1, S, 1]: True where a slot takes part, or added
    scores = (scores.masked_fill(~seen, float("-inf")) if seen.dtype == torch.bool
              else scores + seen.float())
    weights = scores.softmax(dim=-2)
    return (weights * values.float()).sum(dim=-2, keepdim=True).to(q.dtype)  # [B, H, 1, D]


def bag_attention(q: torch.Tensor, ring: BlockKVRing, mask: torch.Tensor) -> torch.Tensor:
    """One query q [B, H, 1, D] over the first S = mask.shape[-1] slots of `ring` (mask
    [B, 1, 1, S]) -> [B, H, 1, D], softmax in fp32.

    Both products are torch's embedding_bag, a weighted sum of table rows that reads its
    table at the memory's rate on the CPU: a block's scores sum its D key rows weighted by
    q, and the answer sums the S value rows weighted by the softmax. torch's matrix
    products read the 7B's bf16 window at 11 to 18 GB/s on two threads, and its flash kernel
    at about 4; the bags at 25 to 30 (bench/floor.py --attention). The scores are rounded to
    the compute dtype before the softmax (a relative 2^-9 in bf16) where the flash kernel
    keeps fp32, so for quantized models only, whose weights' own error is of that order or
    larger and which left bit parity behind."""
    B, H, _, D = q.shape
    S = mask.shape[-1]
    _, _, blocks, _, block = ring.key_blocks.shape
    bags = B * H * blocks
    indices, offsets = bag_rows(bags, D)
    q_rows = q.expand(B, H, blocks, D).reshape(bags * D)  # a block's weights: its head's q
    scores = F.embedding_bag(indices, ring.key_blocks.reshape(bags * D, block), offsets,
                             mode="sum", per_sample_weights=q_rows)  # [B*H*blocks, block]
    scores = scores.view(B, H, 1, blocks * block)[..., :S].float() * D ** -0.5
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
    capacity = ring.capacity
    if S == capacity:
        indices, offsets = bag_rows(B * H, S)
    else:  # the first S slots of each of the B*H rings
        starts = torch.arange(B * H, dtype=torch.int32) * capacity
        indices = (starts[:, None] + torch.arange(S, dtype=torch.int32)).view(-1)
        offsets = torch.arange(0, B * H * S, S, dtype=torch.int32)
    out = F.embedding_bag(indices, ring.values.reshape(B * H * capacity, D), offsets,
                          mode="sum", per_sample_weights=weights.reshape(B * H * S))
    return out.view(B, H, 1, D)


class InputMajorLinear(nn.Module):
    """A bias-free linear whose weight is stored transposed, [in, out] contiguous.

    At batch 1 on the CPU in fp32, x @ W with W [in, out] reads the weight up to twice as
    fast as nn.Linear's x @ W.T when the output is wider than the input (reading the weight
    is the whole cost of such a product: bench/lm_step.py --layouts); for narrower outputs
    nn.Linear's layout is the faster. The products agree to float rounding.
    """

    bias = None  # as a bias-free nn.Linear's

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as nn.Linear holds it, [out, in] (a view)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight_t)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, input-major"


def store_wide_linears_input_major(module: nn.Module) -> list[str]:
    """Swaps every bias-free nn.Linear in `module` whose output is wider than its input for
    an InputMajorLinear, one weight at a time -> the names swapped."""
    names = [name for name, child in module.named_modules()
             if type(child) is nn.Linear and child.bias is None
             and child.out_features > child.in_features]
    for name in names:
        module.set_submodule(name, InputMajorLinear(module.get_submodule(name).weight))
    return names


class LayerScale(nn.Module):
    """A learned per-channel gain on a residual branch (applied with addcmul in MimiLayer)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


class MimiLayer(nn.Module):
    """Pre-norm layer of Mimi's transformers: LayerNorm, attention, LayerScale, GELU MLP."""

    def __init__(self, dim: int, num_heads: int, dim_feedforward: int, context: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.self_attn = Attention(dim, num_heads, context)
        self.layer_scale_1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.linear1 = nn.Linear(dim, dim_feedforward, bias=False)
        self.linear2 = nn.Linear(dim_feedforward, dim, bias=False)
        self.layer_scale_2 = LayerScale(dim)

    def forward(self, x, rope, slots, mask, state, step=0):
        # x + scale * update in one pass, rounded exactly as the two operations are
        x = torch.addcmul(x, self.layer_scale_1.scale,
                          self.self_attn(self.norm1(x), rope, slots, mask, state))
        update = self.linear2(F.gelu(self.linear1(self.norm2(x))))
        return torch.addcmul(x, self.layer_scale_2.scale, update)


class Transformer(Streaming):
    """A stack of pre-norm layers over one KV window: [B, T, C] -> [B, T, C].

    `max_period=None` means no positional encoding at all (the depformer).
    """

    def __init__(self, layers: list[nn.Module], *, context: int, group: int, head_dim: int,
                 max_period: float | None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.context = context
        self.group = group
        self.head_dim = head_dim
        self.max_period = max_period

    def init_state(self, batch: int, device: torch.device, *, dtype: torch.dtype,
                   max_steps: int = 1, window: Window, trim: bool = False,
                   **_: object) -> WindowState:
        capacity = ring_capacity(self.context, max_steps)
        return WindowState(torch.zeros(batch, dtype=torch.long, device=device),
                           torch.full((batch, capacity), -1, dtype=torch.long, device=device),
                           self.context, check_window(window), self.group, trim=trim)

    def forward(self, x: torch.Tensor, state: StreamState | None = None,
                step: int = 0) -> torch.Tensor:
        if state is None:
            state = StreamState.create(self, x.shape[0], dtype=x.dtype, max_steps=x.shape[1],
                                       window="exact", trim=x.dtype == torch.float32)
        positions, slots, mask = state[self].advance(x.shape[1])
        rope = None
        if self.max_period is not None:
            rope = rope_tables(positions, self.head_dim, self.max_period)
        for layer in self.layers:
            x = layer(x, rope, slots, mask, state, step)
        return x


class MimiTransformer(Transformer):
    """Mimi's ProjectedTransformer: [B, C, T] in and out, optional in/out projections."""

    def __init__(self, *, d_model: int, num_heads: int, num_layers: int, dim_feedforward: int,
                 context: int, max_period: float, input_dimension: int,
                 output_dimensions: list[int], group: int, **_: object):
        layers = [MimiLayer(d_model, num_heads, dim_feedforward, context)
                  for _ in range(num_layers)]
        super().__init__(layers, context=context, group=group, head_dim=d_model // num_heads,
                         max_period=max_period)
        self.input_proj = (nn.Linear(input_dimension, d_model, bias=False)
                           if input_dimension != d_model else None)
        out_dim = output_dimensions[0]
        self.output_projs = nn.ModuleList(
            [nn.Linear(d_model, out_dim, bias=False) if out_dim != d_model else nn.Identity()])

    def forward(self, x: torch.Tensor, state: StreamState | None = None,
                step: int = 0) -> torch.Tensor:
        # x: [B, C, T]
        x = x.transpose(1, 2)
        if self.input_proj is not None:
            x = self.input_proj(x)
        x = super().forward(x, state)
        return self.output_projs[0](x).transpose(1, 2)
