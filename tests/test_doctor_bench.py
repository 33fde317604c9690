"""`personaplex doctor --bench`: random weights loaded as reply loads a checkpoint, frames
timed, memory against the count, and the refusal before allocating what does not fit."""

from __future__ import annotations

import json

import pytest
import torch

from personaplex_cli.doctor import bench
from personaplex_cli.errors import DeviceError
from personaplex_cli.model.memory import GIB


def test_tiny_bench_reports_frames_callers_and_memory():
    report = bench.run_bench("tiny", "cpu", "fp32", "int4", frames=3, max_batch=2)
    assert [b.batch for b in report.batches] == [1, 2]
    for b in report.batches:
        assert 0 < b.frame_ms_p50 <= b.frame_ms_p99 and b.prime_s > 0
        assert b.real_time == (b.frame_ms_p99 <= 80)
    assert report.callers_in_real_time in (0, 1, 2)
    assert 0 < report.peak_gib and 0 < report.count_gib
    assert report.graphs_vs_eager is None  # CUDA only
    lines = bench.report_lines(report)
    assert any(line.startswith("callers") for line in lines)


def test_random_weights_go_through_reply_s_loader(monkeypatch):
    """build_lm is the loader reply uses: with the random source it quantizes tensor by
    tensor, so the int4 bench model holds packed int4 linears and no bf16 copy of them."""
    from personaplex_cli.core.quantize import Int4Linear
    from personaplex_cli.model.load import build_lm, default_dep_steps
    from personaplex_cli.model.memory import lm_weight_bytes, tensor_bytes

    arch = bench.bench_arch("tiny")
    steps = default_dep_steps(arch.lm)
    lm = build_lm(arch.lm, steps, torch.device("cpu"), torch.bfloat16, "int4",
                  bench.random_source(arch.lm, torch.device("cpu"), torch.bfloat16, 0))
    assert any(isinstance(m, Int4Linear) for m in lm.modules())
    assert tensor_bytes(lm) == lm_weight_bytes(arch.lm, steps, torch.bfloat16, "int4")


def test_bench_refuses_before_allocating_what_does_not_fit(monkeypatch):
    import personaplex_cli.model.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 4 * GIB)
    built = []
    monkeypatch.setattr(bench, "build_lm", lambda *a, **k: built.append(a))
    with pytest.raises(DeviceError, match="the model needs about .* but only 4.0 GiB"):
        bench.run_bench("full", "cpu", "bf16", "int8")
    assert not built


def test_doctor_bench_cli_json(run_cli):
    proc = run_cli("doctor", "--bench", "--size", "tiny", "--device", "cpu", "--frames", "2",
                   "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["size"] == "tiny" and report["device"] == "cpu"
    assert report["batches"][0]["batch"] == 1 and report["batches"][0]["frame_ms_p50"] > 0
    assert {"callers_in_real_time", "peak_gib", "count_gib", "load_s"} <= set(report)
