"""Quantization of the LM's transformer linears: int8 and fp8 with one scale per row, int4 by groups.

int8          weights q int8 [out, in] with a scale s [out] in the compute dtype, q = round(w / s)
              clamped to +-127, s = max|w_row| / 127 (symmetric, per output channel). On the
              CPU each activation row is quantized too, on the fly, and the product is
              fbgemm's u8 x s8 matmul (VNNI where the CPU has it): x_row ~ a * s_x with a =
              round(x_row / s_x), s_x = max|x_row| / 127, handed to fbgemm as uint8 with zero
              point 128 and scale 1, so its int32 sums are exact and y_row = s_x * s * sum(a q):
              a row's output depends on that row alone, whoever shares the batch. Where the
              CPU has AVX-512 VNNI and a C compiler, the same arithmetic runs in the kernel
              built there (model/native.py: rows.c), to the bit. Elsewhere (CUDA, or a
              torch without fbgemm) int8 is int8-weights.
int8-weights  the same stored bytes, activations left alone: torch's `_weight_int8pack_mm`
              (CPU and CUDA) reads the int8 weights and multiplies in the compute dtype. On the
              CPU it wants bf16 activations (with fp32 ones it is several times slower:
              bench/int8_kernels.py), and it widens every weight, so it is arithmetic-bound
              where fbgemm reads near the memory's rate.
fp8           e4m3 weights with an fp32 scale per row, s = max|w_row| / 448, and each activation
              row scaled to e4m3 on the fly; the matmul is `torch._scaled_mm` (fp8 tensor cores
              from compute capability 8.9 on; torch also emulates it on the CPU, which the
              tests use).

Only the linear layers inside the temporal transformer and the depformer are quantized
(`QUANTIZED_PARTS`): they are 97% of the weights read per frame (7.19 of 7.37 B in the 7B;
embeddings are looked up, not read whole). Embeddings, norms, the depformer's input
projections and the output heads keep the compute dtype, and so does the KV cache. Where
the kernels built here run (AVX-512 VNNI), those bf16 linears are kept in their
tiles (TiledLinear, tile_bf16_linears): sums in fp32 in their own order, which a quantized
model's rounding has room for.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import QUANTIZE_MODES, Quantize
from .layers import Attention, InputMajorLinear

QUANTIZED_PARTS = ("transformer", "depformer")  # LMModel submodules whose linears are quantized

INT8_MAX = 127
# torch 2.13's CPU `_weight_int8pack_mm` in bf16 is only right when the input width is a
# multiple of 16 (measured: 24 and 88 give garbage or crash, 16..80 by 16 are exact). The
# 7B's widths (1024, 2816, 4096, 11264) all are; other shapes take a plain dequantized matmul.
INT8_KERNEL_K = 16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
_TINY = 1e-12  # the scale of an all-zero row: any positive number gives q = 0


QUANTIZE_ROWS = 1024  # rows quantized at a time: fp32 temporaries of a few MB, not 370


def per_row(weight: torch.Tensor, store: torch.dtype, largest: float,
            scale_dtype: torch.dtype, round_to_int: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: w [out, in] -> (w / s in `store`, s [out]), where
    s = max|w_row| / largest, rounded to `scale_dtype` before dividing by it."""
    rows = weight.shape[0]
    q = torch.empty(weight.shape, dtype=store, device=weight.device)
    scale = torch.empty(rows, dtype=scale_dtype, device=weight.device)
    for start in range(0, rows, QUANTIZE_ROWS):
        w = weight[start:start + QUANTIZE_ROWS].to(torch.float32, copy=True)  # divided in place
        s = (w.abs().amax(dim=1) / largest).clamp_(min=_TINY).to(scale_dtype)
        w.div_(s.float()[:, None])
        if round_to_int:
            w.round_().clamp_(-largest, largest)
        q[start:start + QUANTIZE_ROWS] = w  # fp8: rounded to nearest as it is stored
        scale[start:start + QUANTIZE_ROWS] = s
    return q, scale


class QuantizedLinear(nn.Module):
    """A bias-free nn.Linear whose weight is stored quantized, one scale per output row."""

    kind = ""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features

    @staticmethod
    def quantize(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """w [out, in] -> this module's buffers (computing in `dtype`)."""
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None):
        dtype = dtype or linear.weight.dtype
        module = cls(linear.in_features, linear.out_features, dtype=dtype,
                     device=linear.weight.device)
        module.load_state_dict(cls.quantize(linear.weight.detach(), dtype))
        module.prepare()
        return module

    def prepare(self) -> bool:
        """Once its buffers are loaded: whatever its kernel wants done once (nothing here)
        -> whether it did anything."""
        return False

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


# fbgemm's activations are uint8: a row's integers a in -127..127 go in as a + 128, with scale 1.
ACTIVATION_ZERO_POINT = 128
Int8Kernel = Literal["native", "fbgemm", "int8pack", "plain"]

# The int8 kernel built on this machine (model/native.py: rows.c, AVX-512 VNNI), the
# same arithmetic as fbgemm's to the bit, faster on the depformer's small matrices. It
# packs a layer's weight once (`pack(q, scale)` -> NATIVE_BUFFERS, `unpack`) and multiplies
# (`kernel(rows, *buffers)`, or `bind(*buffers)(rows)` -> the rows' dtype). Layers packed
# for it keep it; whether the next ones are is `_PACK_NATIVE`.
_NATIVE = None
_PACK_NATIVE = False
NATIVE_BUFFERS = ("native_blocked", "native_row_sums", "native_scale")


def use_native_int8(kernel) -> None:
    """Layers prepared from now on run `kernel` for int8 with activation rows (None: fbgemm's)."""
    global _NATIVE, _PACK_NATIVE
    _NATIVE = kernel or _NATIVE
    _PACK_NATIVE = kernel is not None


def fbgemm_present() -> bool:
    """Whether this torch has fbgemm's quantized CPU kernels (x86 builds)."""
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32"))


def int8_kernel(device: torch.device, in_features: int, activations: bool) -> Int8Kernel:
    """Which int8 matmul a layer prepared now runs: with each activation row quantized
    (`int8` on the CPU), the kernel built here or else fbgemm's; otherwise torch's
    weight-only kernel, or a plain matmul on the weight cast per call where that kernel
    cannot take the width (INT8_KERNEL_K)."""
    if activations and device.type == "cpu" and _PACK_NATIVE:
        return "native"
    if activations and device.type == "cpu" and fbgemm_present():
        return "fbgemm"
    return "int8pack" if in_features % INT8_KERNEL_K == 0 else "plain"


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] -> (a [M, K] fp32 holding integers in -127..127, s [M, 1] fp32) with
    rows ~ a * s, s = max|row| / 127: each row by its own scale."""
    x = rows.to(torch.float32, copy=True)  # ours to divide in place: no temporaries
    scale = x.abs().amax(dim=1, keepdim=True).div_(INT8_MAX).clamp_(min=_TINY)
    return x.div_(scale).round_(), scale


def fbgemm_rows_linear(rows: torch.Tensor, packed) -> torch.Tensor:
    """rows [M, K] through fbgemm's packed int8 weight, each row quantized on its own ->
    [M, N] fp32."""
    a, scale = quantize_rows(rows)
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        a, 1.0, ACTIVATION_ZERO_POINT, packed)
    return y.mul_(scale)


# fbgemm's packed weights by handle. A layer holds its handle, a tensor torch.compile passes
# along, and never the packed object, which torch.compile cannot trace (a TorchScript class
# without a fake); the entry goes with the layer.
_PACKED: dict[int, object] = {}
_HANDLES = itertools.count(1)


@torch.library.custom_op("personaplex::fbgemm_int8", mutates_args=())
def fbgemm_int8(a: torch.Tensor, handle: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """a [M, K] (quantize_rows' integers, fp32) times the packed weight `handle` names, whose
    row scales are `scale` [N] -> [M, N] fp32, the rows' own scales not yet applied: what
    torch.compile sees of fbgemm, the rows' quantization around it left to compile."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        a, 1.0, ACTIVATION_ZERO_POINT, _PACKED[int(handle)])


@fbgemm_int8.register_fake
def _(a: torch.Tensor, handle: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], scale.shape[0]))


# What torch.compile sees of the native kernel: one op, rows in and out, their quantization
# inside it. Defined without custom_op's Python wrapper, a few microseconds a call less.
_NATIVE_RUNS: dict[int, object] = {}  # each packed layer's bound kernel, by its weight's address
_OPS = torch.library.Library("personaplex", "FRAGMENT")
_OPS.define("native_int8(Tensor rows, Tensor blocked, Tensor row_sums, Tensor scale) -> Tensor")
_OPS.impl("native_int8", lambda rows, blocked, row_sums, scale:
          _NATIVE_RUNS[blocked.data_ptr()](rows), "CPU")


@torch.library.register_fake("personaplex::native_int8")
def _(rows, blocked, row_sums, scale):
    return rows.new_empty((rows.shape[0], scale.shape[0]))


# The bf16 product the same way; `width` (an empty tensor [N]) carries the output's width
# to the fake, as the tiles are padded to whole tiles.
_OPS.define("native_bf16(Tensor rows, Tensor tiles, Tensor width) -> Tensor")
_OPS.impl("native_bf16", lambda rows, tiles, width: _NATIVE_RUNS[tiles.data_ptr()](rows), "CPU")


@torch.library.register_fake("personaplex::native_bf16")
def _(rows, tiles, width):
    return rows.new_empty((rows.shape[0], width.shape[0]))


# The same two products as operators written in C++ (personaplex::int8_rows and bf16_rows,
# model/rows_op.cpp), which compiled code calls with no Python in between: a compiled
# depformer frame calls them 200 times. Loaded where a run compiles (model/native.py's
# direct_ops); until then, and where they cannot be built, the Python operators above.
_DIRECT_OPS = False


def use_direct_ops(loaded: bool) -> None:
    global _DIRECT_OPS
    _DIRECT_OPS = loaded


def native_int8_op(rows: torch.Tensor, *buffers: torch.Tensor) -> torch.Tensor:
    """What compiled code calls for a layer of the native int8 kernel."""
    if _DIRECT_OPS and rows.dtype in (torch.float32, torch.bfloat16):
        return torch.ops.personaplex.int8_rows(rows, *buffers)
    return torch.ops.personaplex.native_int8(rows, *buffers)


def native_bf16_op(rows: torch.Tensor, tiles: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """What compiled code calls for a bf16 linear in the tiles."""
    if _DIRECT_OPS and rows.dtype == torch.bfloat16:
        return torch.ops.personaplex.bf16_rows(rows, tiles, width)
    return torch.ops.personaplex.native_bf16(rows, tiles, width)


def fbgemm_pack(weight_int8: torch.Tensor, scale: torch.Tensor):
    """int8 weights [N, K] and their row scales -> fbgemm's packed weight (its own copy, in
    its blocked layout; the arguments can go once this returns). torch builds it from a
    quantized tensor, a type it has marked deprecated: the warning says nothing to our users
    (bench/int8_kernels.py and tests/test_quantize.py check the kernel is there)."""
    zero = torch.zeros(scale.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(weight_int8, scale.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


class Int8Linear(QuantizedLinear):
    """int8 weights and one scale per output row, in the compute dtype; the activations stay
    in the compute dtype (--quantize int8-weights)."""

    kind = "int8 weight-only"
    activations = False  # whether activation rows are quantized, where a kernel does it

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(in_features, out_features)
        self.register_buffer("weight_int8", torch.empty(out_features, in_features,
                                                        dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=dtype, device=device))
        # fbgemm's copy of the weight, once prepare() made it: its handle in _PACKED
        self.register_buffer("fbgemm_handle", None, persistent=False)
        # or the native kernel's: its layout of the weight, 128 * row sums, fp32 scales;
        # and the kernel bound to them (a plain attribute: eager steps call it directly)
        for name in NATIVE_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        self.native_run = None

    @staticmethod
    def quantize(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """w [out, in] -> this module's buffers. The scale is rounded to `dtype` first and
        q computed against the rounded scale, so no row carries a systematic gain error."""
        q, scale = per_row(weight, torch.int8, INT8_MAX, dtype, round_to_int=True)
        return {"weight_int8": q, "scale": scale}

    def kernel(self) -> Int8Kernel:
        if self.native_blocked is not None:
            return "native"
        if self.fbgemm_handle is not None:
            return "fbgemm"
        return int8_kernel(self.scale.device, self.in_features, self.activations)

    def prepare(self) -> bool:
        """Once loaded: packs the weight for the native kernel or fbgemm where this layer
        runs one, and drops our copy (the packed one replaces it)."""
        if self.native_blocked is not None or self.fbgemm_handle is not None:
            return False
        if self.kernel() == "native":
            buffers = _NATIVE.pack(self.weight_int8, self.scale)
            for name, tensor in zip(NATIVE_BUFFERS, buffers):
                setattr(self, name, tensor)
            self.native_run = _NATIVE.bind(*buffers)
            address = buffers[0].data_ptr()
            _NATIVE_RUNS[address] = self.native_run
            weakref.finalize(self, _NATIVE_RUNS.pop, address, None)
            self.weight_int8 = None
            return True
        if self.kernel() != "fbgemm":
            return False
        handle = next(_HANDLES)
        _PACKED[handle] = fbgemm_pack(self.weight_int8, self.scale.float())
        weakref.finalize(self, _PACKED.pop, handle, None)
        self.fbgemm_handle = torch.tensor(handle)
        self.weight_int8 = None
        return True

    @property
    def packed(self):
        """fbgemm's packed weight, or None."""
        return None if self.fbgemm_handle is None else _PACKED[int(self.fbgemm_handle)]

    def int8_weight(self) -> torch.Tensor:
        """q [out, in] int8, from the packed copy where that is the only one."""
        if self.native_blocked is not None:
            return _NATIVE.unpack(self.native_blocked, self.out_features, self.in_features)
        if self.packed is None:
            return self.weight_int8
        weight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return weight.int_repr()

    def stored_bytes(self) -> int:
        """What this layer holds: the int8 weight (ours, or fbgemm's packed copy of it) and
        the scales; the native kernel's padded copy, its row sums and fp32 scales instead."""
        scales = self.scale.numel() * self.scale.element_size()
        if self.native_blocked is not None:
            return scales + sum(getattr(self, name).nbytes for name in NATIVE_BUFFERS)
        return self.in_features * self.out_features + scales

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed is not None or self.native_blocked is not None:  # unpacked: a copy
            destination[prefix + "weight_int8"] = self.int8_weight()

    def dequantized(self) -> torch.Tensor:
        """The weight these int8 values stand for, [out, in] in the scale's dtype."""
        return (self.int8_weight().float() * self.scale.float()[:, None]).to(self.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.native_run is not None:
            if torch.compiler.is_compiling():
                y = native_int8_op(rows, self.native_blocked, self.native_row_sums,
                                   self.native_scale)
            else:
                y = self.native_run(rows)
            return y.view(*x.shape[:-1], self.out_features)
        if self.fbgemm_handle is not None:
            if torch.compiler.is_compiling():
                a, scale = quantize_rows(rows)
                y = fbgemm_int8(a, self.fbgemm_handle, self.scale).mul_(scale)
            else:
                y = fbgemm_rows_linear(rows, self.packed)
            y = y.to(x.dtype)
        elif self.in_features % INT8_KERNEL_K == 0:
            y = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale)
        else:  # the kernel's bf16 path reads past the rows (wrong sums, or a crash) here
            y = F.linear(rows, self.weight_int8.to(rows.dtype)) * self.scale
        return y.view(*x.shape[:-1], self.out_features)


class Int8RowsLinear(Int8Linear):
    """int8 weights, and on the CPU each activation row quantized to int8 by its own scale
    (--quantize int8): fbgemm's kernel, which reads the weights near the memory's rate."""

    kind = "int8, activations per row"
    activations = True


class Fp8Linear(QuantizedLinear):
    """e4m3 weights with fp32 scales per output row; activations are quantized per row on
    the fly and the product accumulates in fp32."""

    kind = "fp8 e4m3"

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(in_features, out_features)
        self.out_dtype = dtype
        self.register_buffer("weight_fp8", torch.empty(out_features, in_features,
                                                       dtype=FP8_DTYPE, device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32,
                                                  device=device))

    @staticmethod
    def quantize(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        q, scale = per_row(weight, FP8_DTYPE, FP8_MAX, torch.float32, round_to_int=False)
        return {"weight_fp8": q, "scale": scale}

    def dequantized(self) -> torch.Tensor:
        return (self.weight_fp8.float() * self.scale[:, None]).to(self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        x_scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_TINY)
        x_fp8 = (rows / x_scale).to(FP8_DTYPE)
        y = torch._scaled_mm(x_fp8, self.weight_fp8.t(), scale_a=x_scale,
                             scale_b=self.scale.view(1, -1), out_dtype=x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


# int4: one scale and one offset per group of this many weights along a row. Measured with
# bench/int8_kernels.py and bench/quantize_quality.py at 32, 64 and 128 (docs/memory.md, int4).
INT4_GROUP = 64
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's packed int4 kernels take
INT4_LEVELS = 15  # q in 0..15, stored two to a byte
Int4Kernel = Literal["cpu", "cuda", "plain"]


def int4_group(in_features: int) -> int:
    """The group size of a row of `in_features` weights: INT4_GROUP, or the whole row where
    it does not divide (tiny test models only; the 7B's widths are multiples of 1024)."""
    return INT4_GROUP if in_features % INT4_GROUP == 0 else in_features


def int4_inner_tiles(in_features: int) -> int:
    """The CUDA packing's inner K tiles (2, 4 or 8; 16 weights each): the most that divide."""
    return next((t for t in (8, 4, 2) if in_features % (t * 16) == 0), 0)


def int4_kernel(device: torch.device, out_features: int, in_features: int,
                dtype: torch.dtype) -> Int4Kernel:
    """Which int4 matmul a layer runs: torch's packed CPU kernel (rows in 16s), its CUDA
    tensor-core kernel (bf16 activations, rows in 8s, widths in 32s), or a plain matmul on
    the weight unpacked per call where neither takes the shape."""
    group = int4_group(in_features)
    if group not in INT4_GROUPS:
        return "plain"
    if device.type == "cpu" and out_features % 16 == 0:
        return "cpu"
    if (device.type == "cuda" and dtype == torch.bfloat16 and out_features % 8 == 0
            and int4_inner_tiles(in_features)):
        return "cuda"
    return "plain"


def int4_groups(weight: torch.Tensor, dtype: torch.dtype, pack
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise quantization of w [out, in] -> (pack(q) of each chunk of rows
    stacked, scale and zero [out, in / group] in `dtype`), with q int32 in 0..15 and
    w ~ (q - 8) * scale + zero, the form torch's int4 kernels read. Scale and zero are
    rounded to `dtype` before q is computed against them. A chunk of QUANTIZE_ROWS rows at a
    time, packed at once, so the temporaries (fp32, int32) stay a few MB per chunk and the
    whole tensor is never held at 4 bytes a weight."""
    rows, width = weight.shape
    group = int4_group(width)
    packed = None
    scale = torch.empty(rows, width // group, dtype=dtype, device=weight.device)
    zero = torch.empty_like(scale)
    for start in range(0, rows, QUANTIZE_ROWS):
        w = weight[start:start + QUANTIZE_ROWS].to(torch.float32, copy=True)
        w = w.view(w.shape[0], -1, group)
        low, high = torch.aminmax(w, dim=2)
        s = ((high - low) / INT4_LEVELS).clamp_(min=_TINY).to(dtype)
        z = (low + (INT4_LEVELS + 1) / 2 * s.float()).to(dtype)
        w.sub_(z.float()[..., None]).div_(s.float()[..., None]).add_((INT4_LEVELS + 1) / 2)
        q = pack(w.round_().clamp_(0, INT4_LEVELS).flatten(1).to(torch.int32))
        if packed is None:
            packed = torch.empty(rows, *q.shape[1:], dtype=q.dtype, device=weight.device)
        packed[start:start + QUANTIZE_ROWS] = q
        scale[start:start + QUANTIZE_ROWS] = s
        zero[start:start + QUANTIZE_ROWS] = z
    return packed, scale, zero


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] in 0..15 -> uint8 [out, ceil(in / 2)], element 2j in the low nibble."""
    if q.shape[1] % 2:
        q = F.pad(q, (0, 1))
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=2).flatten(1)[:, :width]


class Int4Linear(QuantizedLinear):
    """4-bit weights, two to a byte, with a scale and a zero per group of INT4_GROUP weights
    along each row (asymmetric), multiplied by torch's packed int4 kernels.

    The packed weight is stored as uint8 [out, ceil(in / 2)] whatever the kernel (CUDA's
    int32 tiles are viewed as bytes), so a model built on the meta device has the shapes and
    bytes of the loaded one."""

    kind = "int4"

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(in_features, out_features)
        groups = in_features // int4_group(in_features)
        self.register_buffer("weight_int4", torch.empty(
            out_features, (in_features + 1) // 2, dtype=torch.uint8, device=device))
        # [groups, out, (scale, zero)]: the layout both kernels read
        self.register_buffer("scales_zeros", torch.empty(groups, out_features, 2, dtype=dtype,
                                                         device=device))

    @staticmethod
    def quantize(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out_features, in_features = weight.shape
        kernel = int4_kernel(weight.device, out_features, in_features, dtype)
        if kernel == "cpu":  # packs rows independently, in blocks: chunks equal the whole
            packed, scale, zero = int4_groups(
                weight, dtype, lambda q: torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        elif kernel == "cuda":  # pairs high nibble first, then tiled for the tensor cores
            pairs, scale, zero = int4_groups(
                weight, dtype, lambda q: ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8))
            tiled = torch.ops.aten._convert_weight_to_int4pack(
                pairs, int4_inner_tiles(in_features))
            packed = tiled.view(torch.uint8).reshape(out_features, in_features // 2)
        else:
            packed, scale, zero = int4_groups(weight, dtype, pack_nibbles)
        return {"weight_int4": packed,
                "scales_zeros": torch.stack((scale.t(), zero.t()), dim=2).contiguous()}

    def dequantized(self) -> torch.Tensor:
        """The weight these 4-bit values stand for, [out, in] in the compute dtype (from the
        packed CPU layout only by multiplying the identity through the kernel)."""
        dtype = self.scales_zeros.dtype
        if self.kernel() != "plain":
            eye = torch.eye(self.in_features, dtype=dtype, device=self.weight_int4.device)
            return self(eye).t().contiguous()
        q = unpack_nibbles(self.weight_int4, self.in_features).float()
        group = int4_group(self.in_features)
        scale, zero = self.scales_zeros.float().permute(2, 1, 0)  # each [out, groups]
        q = q.view(self.out_features, -1, group)
        w = (q - (INT4_LEVELS + 1) / 2) * scale[..., None] + zero[..., None]
        return w.flatten(1).to(dtype)

    def kernel(self) -> Int4Kernel:
        return int4_kernel(self.weight_int4.device, self.out_features, self.in_features,
                           self.scales_zeros.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        group = int4_group(self.in_features)
        kernel = self.kernel()
        if kernel == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.weight_int4, group, self.scales_zeros.to(rows.dtype))
        elif kernel == "cuda":
            tiles = int4_inner_tiles(self.in_features)
            tiled = self.weight_int4.view(torch.int32).view(
                self.out_features // 8, self.in_features // (tiles * 16), 32, tiles // 2)
            y = torch._weight_int4pack_mm(rows, tiled, group, self.scales_zeros)
        else:
            y = F.linear(rows, self.dequantized().to(rows.dtype))
        return y.view(*x.shape[:-1], self.out_features)


QUANTIZED_LINEAR: dict[str, type[QuantizedLinear]] = {
    "int8": Int8RowsLinear, "int8-weights": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}


def quantized_linears(lm: nn.Module) -> list[str]:
    """Names (in `lm`) of the linear modules (either layout) that quantization replaces."""
    names = []
    for part in QUANTIZED_PARTS:
        for name, module in getattr(lm, part).named_modules():
            if isinstance(module, (nn.Linear, InputMajorLinear)):
                names.append(f"{part}.{name}")
    return names


def replace_linears(lm: nn.Module, mode: Quantize, dtype: torch.dtype) -> list[str]:
    """Swaps the quantized parts' nn.Linear modules for empty quantized ones on the same
    device (meta, at load: the checkpoint's tensors fill them) -> the names replaced."""
    if mode == "none":
        return []
    if mode not in QUANTIZED_LINEAR:
        raise ValueError(f"unknown quantization {mode!r}; expected one of "
                         f"{', '.join(QUANTIZE_MODES)}")
    cls = QUANTIZED_LINEAR[mode]
    names = quantized_linears(lm)
    for name in names:
        linear = lm.get_submodule(name)
        if linear.bias is not None:
            raise ValueError(f"{name} has a bias; only bias-free linears are quantized")
        lm.set_submodule(name, cls(linear.in_features, linear.out_features, dtype=dtype,
                                   device=linear.weight.device))
    for module in lm.modules():  # parity with the reference's kernels is gone already
        if isinstance(module, Attention):
            module.reference_kernel = False
    return names


class TiledLinear(nn.Module):
    """A bias-free bf16 linear whose weight is kept only in the tiles of the kernel built
    here (model/native.py's NativeBF16: `pack`, `unpack`, `bind`). Its state dict holds the
    weight as nn.Linear's, unpacked, unless it is a second view of weights other modules
    hold (`saved`)."""

    def __init__(self, kernel, tiles: torch.Tensor, out_features: int, in_features: int,
                 saved: bool = True):
        super().__init__()
        self.kernel_face, self.saved = kernel, saved
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("tiles", tiles, persistent=False)
        self.register_buffer("width", torch.empty(out_features, dtype=torch.uint8),
                             persistent=False)
        self.run = kernel.bind(tiles, out_features)
        address = tiles.data_ptr()
        _NATIVE_RUNS[address] = self.run
        weakref.finalize(self, _NATIVE_RUNS.pop, address, None)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as nn.Linear holds it, [out, in] (a copy)."""
        return self.kernel_face.unpack(self.tiles, self.out_features)

    def stored_bytes(self) -> int:
        """The tiles, where they are this layer's own (not a view of others' weights)."""
        return self.tiles.nbytes if self.saved else 0

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.saved:
            destination[prefix + "weight"] = self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = native_bf16_op(rows, self.tiles, self.width)
        else:
            y = self.run(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                "bf16 in the tiles of the kernel built here")


def tile_bf16_linears(lm: nn.Module, kernel, after_each=None) -> list[str]:
    """Once loaded and its depformer inputs fused: a quantized LM's bf16 linears (the text
    head, the depformer's heads and input projections) into TiledLinear, one at a time,
    where `kernel` (model/native.py's NativeBF16) runs them -> the names swapped. The fused
    input projection is packed once, each step's projection a slice of its tiles (left as
    they are where a step's rows do not fill whole tiles: the steps' weights are views of
    the fused one). `after_each()` runs after each swap (the loader hands the freed memory
    back there)."""
    if kernel is None:
        return []
    swapped = []
    fused, steps = getattr(lm, "depformer_in_fused", None), lm.depformer_in
    rows = len(steps) and lm.depformer_in[0].out_features
    if (isinstance(fused, torch.Tensor) and kernel.takes(fused)
            and rows % kernel.block_rows == 0):
        tiles, per_step = kernel.pack(fused), rows // kernel.block_rows
        del lm.depformer_in_fused
        lm.depformer_in_fused = TiledLinear(kernel, tiles, *fused.shape, saved=False)
        for step in range(len(steps)):
            steps[step] = TiledLinear(kernel, tiles[step * per_step:(step + 1) * per_step],
                                      rows, fused.shape[1])
        del fused
        swapped.append("depformer_in")
        if after_each:
            after_each()
    names = [name for name, module in lm.named_modules()
             if type(module) is nn.Linear and module.bias is None
             and kernel.takes(module.weight) and not name.startswith("depformer_in.")]
    for name in names:
        linear = lm.get_submodule(name)
        lm.set_submodule(name, TiledLinear(kernel, kernel.pack(linear.weight.detach()),
                                           linear.out_features, linear.in_features))
        del linear
        swapped.append(name)
        if after_each:
            after_each()
    return swapped


def prepare_linears(lm: nn.Module, after_each=None) -> None:
    """Once loaded, each quantized linear's once-only work (fbgemm's packing), one layer at
    a time; `after_each()` runs after every layer that did some (the loader hands the freed
    memory back there)."""
    for module in list(lm.modules()):
        if isinstance(module, QuantizedLinear) and module.prepare() and after_each:
            after_each()


# What each kernel is called where a run says which one it took (doctor --bench).
KERNEL_NAMES = {"native": "int8 x int8 built here (AVX-512 VNNI), activations per row",
                "fbgemm": "fbgemm int8 x int8, activations per row",
                "int8pack": "torch._weight_int8pack_mm (int8 weights only)",
                "plain": "a plain matmul on the weight widened per call",
                "cpu": "torch's packed int4 kernel (CPU)", "cuda": "torch's int4 tensor-core kernel",
                "fp8": "torch._scaled_mm (fp8)", "none": "F.linear in the compute dtype",
                "tiled": "bf16 x bf16 built here (AVX-512)"}


def linear_kernels(lm: nn.Module, everywhere: bool = False) -> dict[str, int]:
    """The quantized parts' linears (or all the LM's, `everywhere`) by the kernel they run
    -> {kernel: how many}."""
    counts: dict[str, int] = {}
    parts = [lm] if everywhere else [getattr(lm, part) for part in QUANTIZED_PARTS]
    for part in parts:
        for module in part.modules():
            if isinstance(module, (Int8Linear, Int4Linear)):
                kernel = module.kernel()
            elif isinstance(module, Fp8Linear):
                kernel = "fp8"
            elif isinstance(module, TiledLinear):
                if not module.saved:  # a second view of the steps' tiles
                    continue
                kernel = "tiled"
            elif isinstance(module, (nn.Linear, InputMajorLinear)):
                kernel = "none"
            else:
                continue
            counts[kernel] = counts.get(kernel, 0) + 1
    return counts


def kernels_line(lm: nn.Module) -> str:
    """linear_kernels in words, the quantized parts' and then the rest's: "fbgemm int8 x
    int8, activations per row (224 linears); F.linear in the compute dtype (17 linears)"."""
    counts = linear_kernels(lm)
    rest = {kernel: count - counts.get(kernel, 0)
            for kernel, count in linear_kernels(lm, everywhere=True).items()}
    return "; ".join(f"{KERNEL_NAMES[kernel]} ({count} linears)"
                     for kernel, count in [*counts.items(), *rest.items()] if count)


def quantize_weight(mode: Quantize, weight: torch.Tensor, dtype: torch.dtype
                    ) -> dict[str, torch.Tensor]:
    """A linear's weight [out, in] -> the buffers of its quantized replacement."""
    return QUANTIZED_LINEAR[mode].quantize(weight, dtype)
