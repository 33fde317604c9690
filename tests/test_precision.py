"""What runs where, decided once (model/precision.py) and before anything loads: int8, int4 and
fp8 weights by compute capability, dtype, torch and CUDA version, and at every linear shape of
the 7B the kernel each admitted case reaches, run on FakeTensors on a "cuda" device (shapes
and dtypes checked by torch's own meta kernels; no GPU, no memory)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from personaplex_cli.core.config import Arch
from personaplex_cli.core.lm import LMModel
from personaplex_cli.core.quantize import QUANTIZED_LINEAR, quantized_linears
from personaplex_cli.errors import EXIT_DEVICE, DeviceError
from personaplex_cli.model.precision import Where, precision_problem

GPUS = {"T4": (7, 5), "A100": (8, 0), "RTX 3090": (8, 6), "L4": (8, 9), "H100": (9, 0),
        "B200": (10, 0), "RTX 5090": (12, 0), "GB10": (12, 1)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NEW_TORCH, OLD_TORCH = (2, 13), (2, 8)
CUDA_12_8, CUDA_12_9 = (12, 8), (12, 9)


def gpu(name: str, torch_version=NEW_TORCH, cuda=CUDA_12_9) -> Where:
    return Where("cuda", GPUS[name], name, torch_version, cuda)


def runs(where: Where, dtype: str, quantize: str) -> bool:
    return precision_problem(where, dtype, quantize) is None


def seven_b_shapes() -> list[tuple[int, int]]:
    """(out, in) of every linear the quantization replaces in the 7B (8 depformer steps)."""
    with torch.device("meta"):
        lm = LMModel(Arch().lm, 8)
    return sorted({(lm.get_submodule(name).out_features, lm.get_submodule(name).in_features)
                   for name in quantized_linears(lm)})


def test_the_7bs_quantized_shapes():
    assert seven_b_shapes() == [(1024, 1024), (1024, 2816), (3072, 1024), (4096, 4096),
                                (4096, 11264), (5632, 1024), (12288, 4096), (22528, 4096)]


def test_int8_on_a_gpu_needs_torch_2_9():
    for name in GPUS:
        for dtype in DTYPES:
            assert runs(gpu(name), dtype, "int8")
            problem = precision_problem(gpu(name, OLD_TORCH), dtype, "int8")
            assert "torch 2.9 or newer" in problem and "torch 2.8 has no CUDA int8" in problem
    assert runs(Where("cpu", torch=OLD_TORCH), "fp32", "int8")


def test_int4_on_a_gpu_needs_ampere_and_bf16():
    for name, capability in GPUS.items():
        for dtype in DTYPES:
            problem = precision_problem(gpu(name), dtype, "int4")
            if capability < (8, 0):
                assert "compute capability 8.0" in problem and "--quantize int8" in problem
            elif dtype != "bf16":
                assert "bf16 only" in problem and "use --dtype bf16" in problem
            else:
                assert problem is None
    for dtype in DTYPES:
        assert runs(Where("cpu"), dtype, "int4")
    assert "CPU or an NVIDIA GPU" in precision_problem(Where("mps"), "bf16", "int4")


def test_fp8_needs_its_tensor_cores_cublas_and_a_bf16_output_below_hopper():
    expected = {  # (gpu, dtype, cuda) -> runs
        ("L4", "bf16", CUDA_12_9): True, ("L4", "fp16", CUDA_12_9): False,
        ("L4", "fp32", CUDA_12_9): False,
        ("H100", "bf16", CUDA_12_8): True, ("H100", "fp16", CUDA_12_8): False,
        ("H100", "fp16", CUDA_12_9): True, ("H100", "fp32", CUDA_12_9): True,
        ("B200", "fp32", CUDA_12_8): False, ("B200", "fp32", CUDA_12_9): True,
        ("GB10", "bf16", CUDA_12_8): True, ("GB10", "fp16", CUDA_12_9): True,
    }
    for (name, dtype, cuda), want in expected.items():
        problem = precision_problem(gpu(name, cuda=cuda), dtype, "fp8")
        assert (problem is None) == want, (name, dtype, cuda, problem)
        if problem:
            assert "use --dtype bf16" in problem
    for name in ("T4", "A100", "RTX 3090"):  # no fp8 tensor cores: whatever the dtype
        for dtype in DTYPES:
            assert "compute capability 8.9" in precision_problem(gpu(name), dtype, "fp8")
    for dtype in DTYPES:  # row-wise fp8 fails in cuBLAS on 12.0 (pytorch#192707)
        problem = precision_problem(gpu("RTX 5090"), dtype, "fp8")
        assert "fails in cuBLAS on compute capability 12.0" in problem and "int4" in problem
        assert "not the cpu" in precision_problem(Where("cpu"), dtype, "fp8")


def test_every_refusal_names_what_would_work():
    wheres = [gpu(name, version, cuda) for name in GPUS for version in (OLD_TORCH, NEW_TORCH)
              for cuda in (CUDA_12_8, CUDA_12_9)] + [Where("cpu"), Where("mps")]
    refused = 0
    for where in wheres:
        for dtype in DTYPES:
            for quantize in ("none", "int8", "int4", "fp8"):
                problem = precision_problem(where, dtype, quantize)
                if problem is not None:
                    refused += 1
                    assert "use --" in problem or "upgrade torch" in problem or (
                        where.device == "mps"), problem
    assert refused > 50


@pytest.mark.parametrize("quantize", ["int8", "int4", "fp8"])
def test_what_is_admitted_runs_its_kernel_at_every_7b_shape(quantize):
    """On an H100 (torch 2.13, CUDA 12.9), every dtype the decision admits reaches the
    quantization's own CUDA kernel at every shape, which torch's meta kernel accepts; int4
    in another dtype than bf16 would reach none (a plain matmul on a weight unpacked whole
    on every call, 0.37 GB in fp32 for the largest linear): that is why it is refused."""
    cls = QUANTIZED_LINEAR[quantize]
    admitted = [name for name in DTYPES if runs(gpu("H100"), name, quantize)]
    assert admitted == (["bf16"] if quantize == "int4" else list(DTYPES))
    with FakeTensorMode():
        for out_features, in_features in seven_b_shapes():
            for name, dtype in DTYPES.items():
                module = cls(in_features, out_features, dtype=dtype, device="cuda")
                if quantize == "int4":
                    assert module.kernel() == ("cuda" if name in admitted else "plain")
                if name not in admitted:
                    continue
                y = module(torch.empty(4, 1, in_features, dtype=dtype, device="cuda"))
                assert y.shape == (4, 1, out_features) and y.dtype == dtype
    assert 22528 * 4096 * 4 > 0.36e9


def _fake_gpu(monkeypatch, capability, torch_version="2.13.0+cu129", cuda="12.9"):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA X")
    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setattr(torch.version, "cuda", cuda)


def test_the_checks_before_loading_ask_the_device_in_hand(monkeypatch, golden_model):
    """Model (reply, talk, serve) and doctor --bench refuse with exit 5 before any weight
    is read, on what torch says of the GPU."""
    from personaplex_cli.doctor.bench import run_bench
    from personaplex_cli.model.model import Model

    cuda = torch.device("cuda")
    _fake_gpu(monkeypatch, (8, 9))
    with pytest.raises(DeviceError, match="fp8 writes its products in bf16 only") as refused:
        Model(golden_model.files, cuda, torch.float16, quantize="fp8")
    assert refused.value.exit_code == EXIT_DEVICE
    Model(golden_model.files, cuda, torch.bfloat16, quantize="fp8")
    with pytest.raises(DeviceError, match="int4 on a GPU computes in bf16 only"):
        Model(golden_model.files, cuda, torch.float32, quantize="int4")
    _fake_gpu(monkeypatch, (9, 0), "2.8.0+cu128", "12.8")
    with pytest.raises(DeviceError, match="torch 2.9 or newer"):
        Model(golden_model.files, cuda, torch.bfloat16, quantize="int8")
    monkeypatch.setattr("personaplex_cli.doctor.bench.resolve_device", lambda name: cuda)
    with pytest.raises(DeviceError, match="torch 2.9 or newer"):
        run_bench("tiny", "cuda", "bf16", "int8")
