"""Causal streaming convolutions and Mimi's SEANet encoder / decoder.

Module indices in `model` follow the reference (ELUs hold an index too), so the published
keys map onto ours by dropping the reference's wrapper names (see weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .streaming import Rows, StreamState, Streaming, row_index

# Up to this many output steps, a convolution runs as one matrix product: on the short
# chunks of streaming, oneDNN's and ATen's conv kernels spend more on setup than on
# arithmetic (ConvTranspose1d most of all). Long whole-file calls keep the conv kernels.
MATMUL_MAX_STEPS = 512


class RowTensors:
    """A module state made only of tensors with one row per stream."""

    def reset(self, rows: Rows = None) -> None:
        raise NotImplementedError

    def save(self, row: int, used: int) -> list[torch.Tensor]:
        return [tensor[row].clone() for tensor in vars(self).values()]

    def restore(self, row: int, saved: list[torch.Tensor]) -> None:
        for tensor, value in zip(vars(self).values(), saved, strict=True):
            tensor[row] = value


@dataclass
class ConvHistory(RowTensors):
    previous: torch.Tensor  # [B, C_in, P]: the last P input samples
    first: torch.Tensor  # [B] bool: "replicate" padding fills the history from the first sample

    def reset(self, rows: Rows = None) -> None:
        index = row_index(rows, self.previous.device)
        self.previous[index] = 0
        self.first[index] = True


class CausalConv1d(Streaming):
    """Conv1d padded on the left only, with (k-1)*dilation+1-stride samples of history."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 dilation: int = 1, groups: int = 1, bias: bool = True,
                 pad_mode: str = "constant"):
        super().__init__()
        self.stride = stride
        self.dilation = dilation
        self.groups = groups
        self.pad_mode = pad_mode
        self.history = (kernel_size - 1) * dilation + 1 - stride
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None

    def init_state(self, batch: int, device: torch.device, *, dtype: torch.dtype,
                   **_: object) -> ConvHistory:
        shape = (batch, self.weight.shape[1] * self.groups, self.history)
        return ConvHistory(torch.zeros(shape, device=device, dtype=dtype),
                           torch.ones(batch, dtype=torch.bool, device=device))

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        # x: [B, C_in, T] with T a multiple of the stride -> [B, C_out, T / stride]
        hist = (state[self] if state is not None
                else self.init_state(x.shape[0], x.device, dtype=x.dtype))
        if self.history:
            if self.pad_mode == "replicate":
                # A device-side choice, so that a captured CUDA graph stays right.
                start = x[..., :1].expand_as(hist.previous)
                hist.previous.copy_(torch.where(hist.first[:, None, None], start,
                                                hist.previous))
                hist.first.fill_(False)
            x = torch.cat([hist.previous, x], dim=-1)
            hist.previous.copy_(x[..., -self.history:])
        c_out, c_in, k = self.weight.shape
        if self.groups != 1 or self.dilation != 1 or x.shape[-1] > MATMUL_MAX_STEPS * self.stride:
            return F.conv1d(x, self.weight, self.bias, self.stride, dilation=self.dilation,
                            groups=self.groups)
        if k == 1:
            y = torch.matmul(self.weight.view(c_out, c_in), x)
            return y if self.bias is None else y + self.bias[:, None]
        patches = x.unfold(2, k, self.stride).transpose(1, 2)  # [B, T_out, C_in, k]
        patches = patches.reshape(x.shape[0], -1, c_in * k)
        return F.linear(patches, self.weight.view(c_out, c_in * k), self.bias).transpose(1, 2)


@dataclass
class ConvTrTail(RowTensors):
    partial: torch.Tensor  # [B, C_out, K - S]: overlap to add to the next call, bias removed

    def reset(self, rows: Rows = None) -> None:
        self.partial[row_index(rows, self.partial.device)] = 0


class CausalConvTranspose1d(Streaming):
    """ConvTranspose1d that emits T*stride samples per call and carries the overlap."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 groups: int = 1, bias: bool = True):
        super().__init__()
        self.stride = stride
        self.groups = groups
        self.overlap = kernel_size - stride
        self.weight = nn.Parameter(torch.empty(in_channels, out_channels // groups, kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None

    def init_state(self, batch: int, device: torch.device, *, dtype: torch.dtype,
                   **_: object) -> ConvTrTail:
        shape = (batch, self.weight.shape[1] * self.groups, self.overlap)
        return ConvTrTail(torch.zeros(shape, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        # x: [B, C_in, T] -> [B, C_out, T * stride]
        y = self._full(x)  # [B, C_out, (T - 1) * stride + K]
        if not self.overlap:
            return y
        if state is None:
            return y[..., :-self.overlap]
        tail: ConvTrTail = state[self]
        y[..., :self.overlap] += tail.partial
        rest = y[..., -self.overlap:]
        if self.bias is not None:
            rest = rest - self.bias[:, None]
        tail.partial.copy_(rest)
        return y[..., :-self.overlap]

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        c_in, c_out, k = self.weight.shape
        B, _, T = x.shape
        S = self.stride
        if self.groups != 1 or k != 2 * S or T > MATMUL_MAX_STEPS:
            return F.conv_transpose1d(x, self.weight, self.bias, S, groups=self.groups)
        # Each input step writes 2*S samples: its first S onto its own block of S output
        # samples, the second S onto the next block (overlap-add).
        taps = torch.matmul(x.transpose(1, 2), self.weight.view(c_in, c_out * k))
        taps = taps.view(B, T, c_out, 2, S).permute(3, 0, 2, 1, 4)  # [2, B, C_out, T, S]
        y = x.new_zeros(B, c_out, T + 1, S)
        y[:, :, :T] += taps[0]
        y[:, :, 1:] += taps[1]
        y = y.view(B, c_out, (T + 1) * S)
        return y if self.bias is None else y + self.bias[:, None]


class ResBlock(nn.Module):
    """x + conv(ELU(conv(ELU(x)))), channels halved inside (compress)."""

    def __init__(self, dim: int, kernel_size: int, dilation: int, compress: int):
        super().__init__()
        hidden = dim // compress
        self.block = nn.ModuleList([
            nn.ELU(),
            CausalConv1d(dim, hidden, kernel_size, dilation=dilation),
            nn.ELU(),
            CausalConv1d(hidden, dim, 1),
        ])

    def forward(self, x: torch.Tensor, state: StreamState | None) -> torch.Tensor:
        y = self.block[1](self.block[0](x), state)
        y = self.block[3](self.block[2](y), state)
        return x + y


def _run(model: nn.ModuleList, x: torch.Tensor, state: StreamState | None) -> torch.Tensor:
    for layer in model:
        x = layer(x) if isinstance(layer, nn.ELU) else layer(x, state)
    return x


class SEANetEncoder(nn.Module):
    """[B, 1, T] at 24 kHz -> [B, dimension, T / hop]."""

    def __init__(self, *, channels: int, dimension: int, n_filters: int, ratios: list[int],
                 kernel_size: int, residual_kernel_size: int, last_kernel_size: int,
                 n_residual_layers: int, dilation_base: int, compress: int, **_: object):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(channels, n_filters, kernel_size)]
        mult = 1
        for ratio in reversed(ratios):
            width = mult * n_filters
            for j in range(n_residual_layers):
                layers.append(ResBlock(width, residual_kernel_size, dilation_base**j, compress))
            layers += [nn.ELU(), CausalConv1d(width, 2 * width, 2 * ratio, stride=ratio)]
            mult *= 2
        layers += [nn.ELU(), CausalConv1d(mult * n_filters, dimension, last_kernel_size)]
        self.model = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        return _run(self.model, x, state)


class SEANetDecoder(nn.Module):
    """[B, dimension, T] -> [B, 1, T * hop]; no final activation."""

    def __init__(self, *, channels: int, dimension: int, n_filters: int, ratios: list[int],
                 kernel_size: int, residual_kernel_size: int, last_kernel_size: int,
                 n_residual_layers: int, dilation_base: int, compress: int, **_: object):
        super().__init__()
        mult = 2 ** len(ratios)
        layers: list[nn.Module] = [CausalConv1d(dimension, mult * n_filters, kernel_size)]
        for ratio in ratios:
            width = mult * n_filters
            layers += [nn.ELU(), CausalConvTranspose1d(width, width // 2, 2 * ratio, ratio)]
            for j in range(n_residual_layers):
                layers.append(
                    ResBlock(width // 2, residual_kernel_size, dilation_base**j, compress))
            mult //= 2
        layers += [nn.ELU(), CausalConv1d(n_filters, channels, last_kernel_size)]
        self.model = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        return _run(self.model, x, state)
