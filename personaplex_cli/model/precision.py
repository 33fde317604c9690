"""Which weight quantization and compute dtype run where: the one decision of what is refused
before anything loads (model/device.py asks it of the device in hand; doctor of each GPU).

Read in torch's sources (the shared docs' quantization.md), not yet run on a GPU:
  int8  on the CPU fbgemm's int8 x int8 kernel (or the weight-only one without fbgemm); on
        CUDA, like int8-weights, torch._weight_int8pack_mm from torch 2.9 on (no CUDA kernel
        before), where it is a plain loop of one thread per output: the memory is saved,
        the speed is likely below bf16's (not measured: INT8_CUDA_SPEED);
  int4  torch._weight_int4pack_mm: on the CPU; on CUDA from compute capability 8.0 on, with
        bf16 activations only (in another dtype every weight would be unpacked whole on every
        call, a large linear's 0.37 GB in fp32, counted nowhere);
  fp8   row-wise torch._scaled_mm: fp8 tensor cores, compute capability 8.9 on, but not 12.0
        (row-wise fp8 fails in cuBLAS there: pytorch#192707); its product is written in
        bf16 only below capability 9.0, and with cuBLAS before 12.9 (taken as the CUDA
        version torch was built with, whose cuBLAS its wheels bring).
Only the standard library here: doctor decides with it before torch is asked anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import INT4_CUDA_CAPABILITY, INT8_MODES

FP8_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell: fp8 tensor cores
FP8_ROWWISE_BROKEN = ((12, 0),)  # row-wise fp8 fails in cuBLAS (pytorch#192707)
FP8_ANY_OUTPUT = ((9, 0), (12, 9))  # capability and cuBLAS from which any output dtype works
INT8_CUDA_TORCH = (2, 9)  # the first torch with a CUDA _weight_int8pack_mm
# What int8 weights on a GPU cost in speed against bf16, once measured (bench/gpu_check.py):
# None until then.
INT8_CUDA_SPEED: float | None = None


def version(text: str | None) -> tuple[int, int] | None:
    """'2.13.0+cu128' -> (2, 13); None for None or what does not parse."""
    try:
        major, minor = (text or "").split("+")[0].split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()))
    except ValueError:
        return None


@dataclass(frozen=True)
class Where:
    """The device a model would run on, as far as the decision needs it."""

    device: str  # "cpu", "cuda", "mps"...
    capability: tuple[int, int] | None = None  # a CUDA GPU's compute capability
    name: str = ""  # the GPU's name, for the message
    torch: tuple[int, int] | None = None  # torch's version
    cuda: tuple[int, int] | None = None  # the CUDA version torch was built with

    def __str__(self) -> str:
        if self.device != "cuda":
            return f"the {self.device}"
        return f"{self.name or 'this GPU'} ({_dotted(self.capability)})"


def _dotted(pair: tuple[int, int] | None) -> str:
    return "unknown" if pair is None else f"{pair[0]}.{pair[1]}"


def precision_problem(where: Where, dtype: str, quantize: str) -> str | None:
    """Why LM weights quantized as `quantize`, computing in `dtype` ("bf16", "fp16",
    "fp32"), cannot run `where`, as a phrase naming what would; None when they can."""
    if quantize in INT8_MODES:  # the same weight-only kernel on CUDA
        return _int8(where, quantize)
    if quantize == "int4":
        return _int4(where, dtype)
    if quantize == "fp8":
        return _fp8(where, dtype)
    return None


def _int8(where: Where, quantize: str) -> str | None:
    if where.device != "cuda" or where.torch is None or where.torch >= INT8_CUDA_TORCH:
        return None
    int4 = "" if _int4(where, "bf16") else "use --quantize int4, or "
    return (f"--quantize {quantize} on a GPU needs torch {_dotted(INT8_CUDA_TORCH)} or newer (torch "
            f"{_dotted(where.torch)} has no CUDA int8 kernel): upgrade torch, or {int4}give "
            "no --quantize")


def _int4(where: Where, dtype: str) -> str | None:
    if where.device == "cpu":
        return None
    if where.device != "cuda":
        return f"--quantize int4 runs on the CPU or an NVIDIA GPU, not {where.device}"
    if where.capability is not None and where.capability < INT4_CUDA_CAPABILITY:
        return (f"--quantize int4 needs compute capability {_dotted(INT4_CUDA_CAPABILITY)} "
                f"or newer on a GPU; {where.name or 'this GPU'} has "
                f"{_dotted(where.capability)}: use --quantize int8, or --device cpu")
    if dtype != "bf16":
        return (f"--quantize int4 on a GPU computes in bf16 only (torch's int4 kernel), not "
                f"{dtype}: use --dtype bf16")
    return None


def _fp8(where: Where, dtype: str) -> str | None:
    if where.device != "cuda":
        return (f"--quantize fp8 needs an NVIDIA GPU of compute capability "
                f"{_dotted(FP8_CAPABILITY)} or newer, not {where}: use --quantize int8")
    if where.capability is None:
        return None
    if where.capability < FP8_CAPABILITY:
        return (f"--quantize fp8 needs compute capability {_dotted(FP8_CAPABILITY)} or newer; "
                f"{where.name or 'this GPU'} has {_dotted(where.capability)}: use --quantize "
                "int8")
    if where.capability in FP8_ROWWISE_BROKEN:
        return (f"--quantize fp8 fails in cuBLAS on compute capability "
                f"{_dotted(where.capability)} ({where.name or 'this GPU'}): use --quantize "
                "int4 or int8")
    capability, cublas = FP8_ANY_OUTPUT
    if dtype != "bf16" and (where.capability < capability or where.cuda is None
                            or where.cuda < cublas):
        return (f"--quantize fp8 writes its products in bf16 only on {where} with CUDA "
                f"{_dotted(where.cuda)} (another dtype needs compute capability "
                f"{_dotted(capability)} and cuBLAS {_dotted(cublas)}): use --dtype bf16")
    return None


def int8_on_gpu_note(saved_bytes: float) -> str:
    """What int8 weights on a GPU buy and cost, for doctor."""
    speed = ("its speed on a GPU is not measured yet (torch's CUDA kernel is a plain loop, "
             "likely slower than bf16)" if INT8_CUDA_SPEED is None else
             f"a step takes {INT8_CUDA_SPEED:.2f}x bf16's")
    return f"int8 weights save {saved_bytes / 2 ** 30:.1f} GiB against bf16; {speed}"
