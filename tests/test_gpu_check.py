"""bench/gpu_check.py cannot run here (no GPU); its plan can be checked: every step inside
the 8-minute budget, every script it names present, every doctor option it passes known."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_plan_fits_its_budget_and_names_what_exists():
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "problem:" not in proc.stdout
    lines = proc.stdout.splitlines()
    assert int(lines[-1].split()[0]) <= 480  # "480 s  in all (budget 480 s)"
    for quantize in ("none", "int8", "int4", "fp8"):
        assert f"--quantize {quantize}" in proc.stdout
    assert "--callers 1,8,32,64" in proc.stdout and "--batch 64" in proc.stdout


def test_gpu_check_finds_a_broken_plan():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    steps = gpu_check.plan("cuda")
    broken = steps + [gpu_check.Step("gone", [sys.executable, "bench/missing.py"], 60, "text")]
    problems = gpu_check.check_plan(broken)
    assert any("missing.py does not exist" in p for p in problems)
    assert any("over 480 s" in p for p in problems)


def test_gpu_check_names_a_module_the_clean_install_lacks():
    """A checkout installed as the README says (`pip install .`) has no pytest: the dry run
    says so before a GPU's minutes are spent on a step that cannot start."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    broken = [gpu_check.Step("tests", [sys.executable, "-m", "no_such_test_runner", "-q"],
                             40, "text")]
    problems = gpu_check.check_plan(broken)
    assert any("no_such_test_runner is not installed" in p and ".[test]" in p
               for p in problems), problems
