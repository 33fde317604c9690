"""Which compute device and precision a model runs with: decided here, once."""

from __future__ import annotations

import torch

from ..errors import DeviceError


def resolve_device(name: str) -> torch.device:
    """`auto|cpu|cuda[:N]` -> torch.device, or DeviceError when it is not there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{name} was requested but CUDA is not available here")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"{name} was requested but there are only "
                              f"{torch.cuda.device_count()} CUDA devices")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """The LM's precision unless asked otherwise: bf16 on CUDA (as released), fp32 on CPU
    (exact to the reference, and CPUs gain little from bf16)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
