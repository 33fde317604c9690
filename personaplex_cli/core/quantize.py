"""Weight-only quantization of the LM's transformer linears: int8 and fp8, one scale per row.

int8  y = x @ (q * s).T with q int8 [out, in] and s [out] in the compute dtype,
      q = round(w / s) clamped to +-127, s = max|w_row| / 127 (symmetric, per output
      channel). The matmul is torch's own `_weight_int8pack_mm` (CPU and CUDA), which reads
      the int8 weights directly: half the bytes of bf16 per frame. On the CPU it wants bf16
      activations (with fp32 ones it is several times slower: bench/int8_kernels.py).
fp8   e4m3 weights with an fp32 scale per row, s = max|w_row| / 448, and each activation row
      scaled to e4m3 on the fly; the matmul is `torch._scaled_mm` (fp8 tensor cores from
      compute capability 8.9 on; torch also emulates it on the CPU, which the tests use).

Only the linear layers inside the temporal transformer and the depformer are quantized
(`QUANTIZED_PARTS`): they are 97% of the weights read per frame (7.19 of 7.37 B in the 7B;
embeddings are looked up, not read whole). Embeddings, norms, the depformer's input
projections and the output heads keep the compute dtype, and so does the KV cache:
weight-only quantization changes how weights are stored, nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import QUANTIZE_MODES, Quantize
from .layers import InputMajorLinear

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
        return module

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Int8Linear(QuantizedLinear):
    """int8 weights and one scale per output row, in the compute dtype."""

    kind = "int8"

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(in_features, out_features)
        self.register_buffer("weight_int8", torch.empty(out_features, in_features,
                                                        dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=dtype, device=device))

    @staticmethod
    def quantize(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """w [out, in] -> this module's buffers. The scale is rounded to `dtype` first and
        q computed against the rounded scale, so no row carries a systematic gain error."""
        q, scale = per_row(weight, torch.int8, INT8_MAX, dtype, round_to_int=True)
        return {"weight_int8": q, "scale": scale}

    def dequantized(self) -> torch.Tensor:
        """The weight these int8 values stand for, [out, in] in the scale's dtype."""
        return (self.weight_int8.float() * self.scale.float()[:, None]).to(self.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.in_features % INT8_KERNEL_K == 0:
            y = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale)
        else:  # the kernel's bf16 path reads past the rows (wrong sums, or a crash) here
            y = F.linear(rows, self.weight_int8.to(rows.dtype)) * self.scale
        return y.view(*x.shape[:-1], self.out_features)


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


QUANTIZED_LINEAR: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "fp8": Fp8Linear}


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
    return names


def quantize_weight(mode: Quantize, weight: torch.Tensor, dtype: torch.dtype
                    ) -> dict[str, torch.Tensor]:
    """A linear's weight [out, in] -> the buffers of its quantized replacement."""
    return QUANTIZED_LINEAR[mode].quantize(weight, dtype)
