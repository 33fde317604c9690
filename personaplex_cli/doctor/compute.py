"""Python, torch and the GPUs: each CUDA GPU against the torch build's kernels and against
the memory the model needs (model/memory.py's arithmetic, imported when a figure is asked
for: it needs torch)."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

from ..core.config import DTYPE_NAMES, INT8_MODES, QUANTIZE_MODES
from ..errors import EXIT_DEVICE, EXIT_FAILURE
from .check import FAIL, OK, WARN, Check

MIN_PYTHON = (3, 10)  # pyproject's requires-python
CUDA_TORCH_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cu128"
CUDA_TORCH_FIX = f"install a torch build for CUDA 12.8+, e.g. {CUDA_TORCH_INSTALL}"
CPU_ONLY = ("encode and decode run fine on the CPU; reply works but the 7B model runs far "
            "below real time; talk cannot keep up")


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    detail = f"{version} ({sys.executable})"
    if sys.version_info[:2] < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Check("python", FAIL, detail, f"install Python {need} or newer", EXIT_FAILURE)
    return Check("python", OK, detail)


# -- the memory need, by model/memory.py ------------------------------------------------------

def gpu_memory_needed_gib(dtype: str = "bf16", streams: int = 1, quantize: str = "none",
                          arch=None) -> float:
    """GPU memory PersonaPlex needs for `streams` streams, in GiB, by model/memory.py: the
    weights and KV rings counted from the architecture (only the 8 assistant depformer steps
    are loaded; the KV stays at `dtype` whatever the quantization), Mimi in fp32, and a CUDA
    margin that is an estimate until measured on a GPU. `arch`: the model's architecture
    (core.config.Arch; None: the published model's)."""
    from ..model.memory import GIB, personaplex_need

    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_NAMES)}")
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantization {quantize!r}")
    return personaplex_need(dtype, quantize, streams, arch=arch).total / GIB


def _needed_bytes(dtype: str, quantize: str, arch=None) -> float:
    from ..model.memory import GIB

    return gpu_memory_needed_gib(dtype, quantize=quantize, arch=arch) * GIB


def _cpu_bytes(dtype: str, quantize: str, arch=None) -> int:
    from ..model.memory import personaplex_need

    return personaplex_need(dtype, quantize, device_type="cpu", arch=arch).total


def model_arch(model: str | None):
    """The architecture of the model folder doctor was given (its personaplex-arch.json),
    for the memory figures; None (the published model's) for a hub id, or a folder that
    does not say."""
    from pathlib import Path

    if not model or not Path(model).is_dir():
        return None
    try:
        from ..model.files import ModelDir
        from ..model.load import read_arch

        return read_arch(ModelDir(Path(model), model))
    except Exception:  # noqa: BLE001 - the model check says what is wrong with the folder
        return None


def _gib(n: float) -> str:
    from ..model.memory import gib

    return gib(n)


# -- the GPUs -----------------------------------------------------------------------------------

def nvidia_visible() -> str | None:
    """Where an NVIDIA GPU shows up outside torch (its driver), or None."""
    if os.path.exists("/proc/driver/nvidia"):
        return "/proc/driver/nvidia"
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is on PATH"
    return None


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int]
    total_bytes: int
    free_bytes: int | None  # None when it could not be read


def sm_codes(arch_list: list[str]) -> list[int]:
    """['sm_80', 'sm_90a', 'sm_120', 'compute_120'] -> [80, 90, 120] (machine code only)."""
    codes = []
    for arch in arch_list:
        digits = arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz") if arch.startswith("sm_") else ""
        if digits.isdigit():
            codes.append(int(digits))
    return codes


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build with `arch_list` (torch.cuda.get_arch_list()) has kernels for a
    GPU of compute capability (major, minor): some sm_XY with X == major and Y <= minor
    (machine code runs on later GPUs of the same major version only; PTX is not counted, as
    torch's own warning does not count it)."""
    major, minor = capability
    return any(code // 10 == major and code % 10 <= minor for code in sm_codes(arch_list))


def too_small(gpu: Gpu, dtype: str, quantize: str = "none", arch=None) -> bool:
    return gpu.total_bytes < _needed_bytes(dtype, quantize, arch)


def gpu_verdict(gpu: Gpu, arch_list: list[str] | None, dtype: str,
                quantize: str = "none", arch=None, torch_version: tuple[int, int] | None = None,
                cuda_version: tuple[int, int] | None = None) -> Check:
    """One GPU against the torch build's kernels (`arch_list`; None: not checked, as on
    ROCm), the quantization's and dtype's (model/precision.py, for torch and CUDA of those
    versions), and the model's memory need at `dtype` and `quantize`."""
    from ..model.precision import Where, int8_on_gpu_note, precision_problem

    where = Where("cuda", gpu.capability, gpu.name, torch_version, cuda_version)
    need = _needed_bytes(dtype, quantize, arch)
    sm = f"sm_{gpu.capability[0]}{gpu.capability[1]}"
    free = "free unknown" if gpu.free_bytes is None else f"{_gib(gpu.free_bytes)} free"
    weights = "" if quantize == "none" else f" with {quantize} weights"
    detail = (f"{gpu.name} ({sm}), {_gib(gpu.total_bytes)}, {free}; the model at {dtype}"
              f"{weights} needs about {_gib(need)} (counted from the architecture; the CUDA "
              "margin is an estimate, not measured)")
    name = f"gpu{gpu.index}"
    if arch_list is not None and not arch_supported(gpu.capability, arch_list):
        built = " ".join(a for a in arch_list if a.startswith("sm_")) or "none"
        detail = f"{gpu.name} ({sm}) is not supported by this torch build (kernels for: {built})"
        if gpu.capability[0] * 10 + gpu.capability[1] > max(sm_codes(arch_list), default=0):
            return Check(name, FAIL, detail, CUDA_TORCH_FIX, EXIT_DEVICE)
        return Check(name, FAIL, detail, "this torch is too new for this GPU: install an "
                     "older torch build that still has its kernels, or use --device cpu",
                     EXIT_DEVICE)
    problem = precision_problem(where, dtype, quantize)
    if problem:
        why, _, fix = problem.partition(": ")
        return Check(name, FAIL, f"{detail}; {why}", fix, EXIT_DEVICE)
    if too_small(gpu, dtype, quantize, arch):
        for other_dtype, other_quantize, words in (
                ("bf16", quantize, "--dtype bf16"), (dtype, "int8", "--quantize int8"),
                ("bf16", "int8", "--dtype bf16 --quantize int8"),
                (dtype, "int4", "--quantize int4"), ("bf16", "int4", "--dtype bf16 --quantize int4")):
            if precision_problem(where, other_dtype, other_quantize):
                continue
            if (other_dtype, other_quantize) != (dtype, quantize) and not too_small(
                    gpu, other_dtype, other_quantize, arch):
                smaller = _needed_bytes(other_dtype, other_quantize, arch)
                return Check(name, FAIL, detail, f"use {words} (about {_gib(smaller)}) on "
                             "this GPU", EXIT_DEVICE)
        return Check(name, FAIL, detail,
                     f"reply and talk need a GPU with {_gib(need)}: use --device cpu on this "
                     "machine (slow), or a bigger GPU", EXIT_DEVICE)
    if quantize in INT8_MODES:
        detail += "; " + int8_on_gpu_note(_needed_bytes(dtype, "none") - need)
    if gpu.free_bytes is not None and gpu.free_bytes < need:
        return Check(name, WARN, detail, "other processes hold its memory: stop them (see "
                     "nvidia-smi) before reply or talk")
    return Check(name, OK, detail)


def check_torch_and_gpus(dtype: str | None = None, quantize: str = "none", arch=None
                         ) -> list[Check]:
    """torch's version and CUDA build; each CUDA GPU against the build and the memory need,
    at `dtype`, else at the precision a run on that device defaults to (model/device.py)."""
    import warnings

    try:
        import torch
    except ImportError as error:
        return [Check("torch", FAIL, f"torch cannot be imported ({error})",
                      "pip install torch (see https://pytorch.org/get-started/locally/)",
                      EXIT_DEVICE),
                Check("gpu", WARN, "no GPU check without torch",
                      "install torch, then run doctor again: it counts the memory the model "
                      "needs on your GPU")]
    if dtype is None:
        from ..model.device import default_dtype_name

        gpu_dtype, cpu_dtype = default_dtype_name("cuda"), default_dtype_name("cpu")
    else:
        gpu_dtype = cpu_dtype = dtype
    weights = "" if quantize == "none" else f" with {quantize} weights"
    no_gpu_fix = (f"for reply and talk use an NVIDIA GPU with at least "
                  f"{_gib(_needed_bytes(gpu_dtype, quantize, arch))} free at {gpu_dtype}"
                  f"{weights} "
                  "(counted from the architecture; the CUDA margin is an estimate, not "
                  "measured)")
    version = torch.__version__
    cuda = torch.version.cuda
    rocm = getattr(torch.version, "hip", None)
    driver = nvidia_visible()
    with warnings.catch_warnings():  # torch's own GPU warnings: the checks below say it
        warnings.simplefilter("ignore")
        try:
            available = bool(torch.cuda.is_available())
            count = torch.cuda.device_count() if available else 0
        except Exception as error:  # a broken driver raises from inside torch
            available, count = False, 0
            driver = driver or f"torch.cuda ({type(error).__name__}: {error})"
        checks = []
        if rocm:
            checks.append(Check("torch", OK, f"{version} (ROCm {rocm} build)"))
        elif cuda is None:
            detail = f"{version} (CPU build)"
            if driver:
                checks.append(Check(
                    "torch", WARN, f"{detail}, but an NVIDIA GPU is visible ({driver})",
                    f"install the CUDA build of torch, e.g. {CUDA_TORCH_INSTALL}"))
            else:
                checks.append(Check("torch", OK, detail))
        else:
            kernels = " ".join(torch.cuda.get_arch_list())
            detail = f"{version} (CUDA {cuda} build; {kernels or 'no kernels listed'})"
            if not available and driver:
                checks.append(Check(
                    "torch", WARN, f"{detail}, but CUDA is not usable though an NVIDIA GPU is "
                    f"visible ({driver})", f"install an NVIDIA driver that supports CUDA {cuda} "
                    "(nvidia-smi shows the driver's CUDA version), or a torch build for yours"))
            else:
                checks.append(Check("torch", OK, detail))
        if count == 0:
            checks.append(Check("gpu", WARN, f"no CUDA GPU{' usable by torch' if driver else ''}"
                                f": {CPU_ONLY}; on this CPU the model runs at {cpu_dtype}"
                                f"{weights} in about "
                                f"{_gib(_cpu_bytes(cpu_dtype, quantize, arch))} "
                                "of memory", no_gpu_fix))
            return checks
        arch_list = None if rocm else list(torch.cuda.get_arch_list())
        gpus = []
        for index in range(count):
            try:
                props = torch.cuda.get_device_properties(index)
                gpu_name, capability = props.name, (props.major, props.minor)
                total = int(props.total_memory)
            except Exception as error:
                checks.append(Check(f"gpu{index}", FAIL, f"cannot query GPU {index} "
                                    f"({type(error).__name__}: {error})",
                                    "check the driver with nvidia-smi", EXIT_DEVICE))
                continue
            try:
                free: int | None = int(torch.cuda.mem_get_info(index)[0])
            except Exception:
                free = None
            gpus.append(Gpu(index, gpu_name, capability, total, free))
    from ..model.precision import version

    verdicts = [gpu_verdict(gpu, arch_list, gpu_dtype, quantize, arch,
                            version(torch.__version__),
                            version(torch.version.cuda)) for gpu in gpus]
    fits = [gpu.index for gpu, v in zip(gpus, verdicts) if v.status == OK]
    for gpu, verdict in zip(gpus, verdicts):
        if fits and verdict.status == FAIL and too_small(gpu, gpu_dtype, quantize, arch) and (
                arch_list is None or arch_supported(gpu.capability, arch_list)):
            # Another GPU can run the model: say which, rather than fail.
            verdict = Check(verdict.name, WARN, verdict.detail,
                            f"too small for reply and talk: use --device cuda:{fits[0]}")
        checks.append(verdict)
    return checks
