"""bench/gpu_check.py cannot run here (no GPU); its plan can be checked (every step inside
the 8-minute budget, by the arithmetic of its docstring, every script, module, data file and
doctor option it names present), and its in-process steps rehearsed on the CPU with the tiny
model, so that what would fail on the GPU fails here first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gpu_check():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_gpu_check_plan_fits_its_budget_and_its_dry_run_rehearses_it():
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "problem:" not in proc.stdout
    lines = [line.strip() for line in proc.stdout.splitlines()]
    assert "460 s  in all (budget 480 s)" in lines
    for step in ("refusals", "7b", "cli"):
        assert any(line.startswith(f"rehearsed {step} on the CPU") for line in lines)


def test_the_plan_is_the_docstrings_arithmetic_and_covers_the_issue():
    gpu_check = _gpu_check()
    steps = {step.name: step for step in gpu_check.plan("cuda")}
    assert list(steps) == ["agree", "refusals", "cli", "cuda:1", "tests", "7b"]
    limits = dict(re.findall(r"^  (\S+)\s+limit\s+(\d+):", gpu_check.__doc__, re.M))
    assert {name: int(limit) for name, limit in limits.items()} == {
        name: step.limit_s for name, step in steps.items()}
    total = int(re.search(r"^  in all\s+(\d+) s", gpu_check.__doc__, re.M).group(1))
    assert total == sum(step.limit_s for step in steps.values()) <= gpu_check.BUDGET_S
    assert steps["cuda:1"].needs_gpus == 2 and "cuda:1" in steps["cuda:1"].command
    assert gpu_check.LIVE_COUNTS == (1, 8, 32, 64)
    assert set(gpu_check.CARD_GIB) == {"none", "int8", "int4"}


def test_gpu_check_finds_a_broken_plan():
    gpu_check = _gpu_check()
    steps = gpu_check.plan("cuda")
    broken = steps + [gpu_check.Step("gone", [sys.executable, "bench/missing.py"], 60, "text")]
    problems = gpu_check.check_plan(broken)
    assert any("missing.py does not exist" in p for p in problems)
    assert any("over 480 s" in p for p in problems)


def test_gpu_check_names_a_module_the_clean_install_lacks():
    """A checkout installed as the README says (`pip install .`) has no pytest: the dry run
    says so before a GPU's minutes are spent on a step that cannot start."""
    gpu_check = _gpu_check()
    broken = [gpu_check.Step("tests", [sys.executable, "-m", "no_such_test_runner", "-q"],
                             40, "text")]
    problems = gpu_check.check_plan(broken)
    assert any("no_such_test_runner is not installed" in p and ".[test]" in p
               for p in problems), problems


def test_gpu_frame_runs_at_the_tiny_size_on_the_cpu():
    """bench/gpu_frame.py (the GPU's frame times by mode) builds the runtime through doctor's
    BenchModel: run eager on the CPU at the tiny size, so a change of that face breaks this
    test, not the next GPU session."""
    proc = subprocess.run([sys.executable, "bench/gpu_frame.py", "--tiny", "--device", "cpu",
                           "--frames", "3", "--modes", "eager", "--quantize", "none,int8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.startswith(("none", "int8 "))]
    assert [row[:2] for row in rows] == [["none", "eager"], ["int8", "eager"]]
    assert all(float(row[2]) > 0 for row in rows)  # p50 ms of a frame
