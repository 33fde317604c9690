"""Which compute device and precision a model runs with: decided here, once."""

from __future__ import annotations

import torch

from ..core.config import DTYPE_NAMES
from ..errors import DeviceError
from .precision import Where, precision_problem, version

DTYPES = dict(zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32)))


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


def cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


def default_dtype(device: torch.device) -> torch.dtype:
    """The LM's precision unless asked otherwise: bf16 on CUDA (as released), and on a CPU
    that computes bf16 natively, where the 7B fits in 16 GiB instead of 31 and a batch of 8
    costs several times less than in fp32 (one stream up to twice more per layer:
    bench/int8_kernels.py). Other CPUs emulate bf16 slowly, so they keep fp32.
    `--dtype fp32` is exact to the reference everywhere."""
    if device.type == "cuda" or (device.type == "cpu" and cpu_computes_bf16()):
        return torch.bfloat16
    return torch.float32


def default_dtype_name(device_type: str) -> str:
    """`default_dtype` by name ("bf16" or "fp32") for a kind of device, for what sizes a
    run without opening one (doctor)."""
    return "bf16" if default_dtype(torch.device(device_type)) == torch.bfloat16 else "fp32"


def wide_linears_input_major(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the LM's linears with outputs wider than inputs store their weights
    transposed (core.layers.InputMajorLinear): on the CPU in fp32. Measured per call
    (bench/lm_step.py --layouts), [in, out] against [out, in]: 0.44-0.6x for the small
    models' shapes at batch 1 on 1 thread, 0.7-0.9x at batch 4 and 8; 0.68-0.91x for the
    7B's at batch 1 on 2 threads, 0.73-1.09x at batch 8. In bf16 it was within 10% either
    way, and CUDA's matmuls were not measured, so both keep nn.Linear."""
    return device.type == "cpu" and dtype == torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16" (DTYPES' names)."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def where(device: torch.device) -> Where:
    """What the precision decision needs to know of `device` (model/precision.py)."""
    if device.type != "cuda":
        return Where(device.type)
    return Where("cuda", tuple(torch.cuda.get_device_capability(device)),
                 torch.cuda.get_device_name(device), version(torch.__version__),
                 version(torch.version.cuda))


def quantize_problem(device: torch.device, quantize: str,
                     dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why `quantize` weights computing in `dtype` cannot run on `device`, or None."""
    if quantize == "none":
        return None
    return precision_problem(where(device), dtype_name(dtype), quantize)


def check_quantize(device: torch.device, quantize: str,
                   dtype: torch.dtype = torch.bfloat16) -> None:
    """DeviceError (exit 5, naming what would work) before anything loads, where the
    quantization's kernels cannot run on `device` in `dtype`."""
    problem = quantize_problem(device, quantize, dtype)
    if problem:
        raise DeviceError(problem)


def check_graphs(device: torch.device, graphs: bool | None) -> None:
    """DeviceError (exit 5) for --graphs on where no CUDA graph can be captured."""
    if graphs and device.type != "cuda":
        raise DeviceError(f"--graphs on needs a CUDA device, not the {device.type}: use "
                          "--graphs auto or off")
