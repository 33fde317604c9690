"""Which compute device and precision a model runs with: decided here, once."""

from __future__ import annotations

import torch

from ..core.config import DTYPE_NAMES, INT4_CUDA_CAPABILITY
from ..errors import DeviceError

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


FP8_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell: fp8 tensor cores


def quantize_problem(device: torch.device, quantize: str) -> str | None:
    """Why `quantize` cannot run on `device`, in a phrase, or None."""
    if quantize == "int4":
        return int4_problem(device)
    if quantize != "fp8":
        return None
    if device.type != "cuda":
        return (f"--quantize fp8 needs an NVIDIA GPU of compute capability "
                f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer, not the {device.type}: "
                "use --quantize int8")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"--quantize fp8 needs compute capability {FP8_CAPABILITY[0]}."
                f"{FP8_CAPABILITY[1]} or newer; {name} has {capability[0]}.{capability[1]}: "
                "use --quantize int8")
    return None


def int4_problem(device: torch.device) -> str | None:
    """int4 runs on the CPU, and on CUDA where torch's int4 tensor-core kernel does."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"--quantize int4 runs on the CPU or an NVIDIA GPU, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < INT4_CUDA_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"--quantize int4 needs compute capability {INT4_CUDA_CAPABILITY[0]}."
                f"{INT4_CUDA_CAPABILITY[1]} or newer on a GPU; {name} has "
                f"{capability[0]}.{capability[1]}: use --quantize int8, or --device cpu")
    return None


def check_quantize(device: torch.device, quantize: str) -> None:
    problem = quantize_problem(device, quantize)
    if problem:
        raise DeviceError(problem)
