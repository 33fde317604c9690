"""Everything the project measures on a GPU, in one command, into one JSON file, in 8 minutes.

For the first time a GPU is lent: each step runs as its own process with its own time limit,
inside a total of BUDGET_S; a step that would not fit in what is left is recorded as skipped,
one that fails or runs out of time is recorded with its exit status and the tail of its
output, and the file is written after every step, so a run cut short keeps what it measured.

  doctor     `personaplex doctor --bench --json` at the real size (random weights, nothing
             downloaded) for bf16, int8, int4 and fp8: load, frame p50/p99 at batch 1 and
             at the batch memory holds, callers in real time, peak memory against the
             count, graph replay against eager;
  graphs     the CUDA graph tests (tests/test_graphs.py, skipped without a GPU);
  frame      bench/gpu_frame.py, a whole frame at the real size, eager and graphs, at batch
             1, 2, 4, 8, 16, 32 and 64;
  serve      bench/serve.py, real-time WebSocket callers against `personaplex serve` at 1, 8,
             32 and 64 callers, on its mid model (the 7B would need its 17 GB
             folder written first).

Run: python bench/gpu_check.py [--out gpu_check.json] [--device cuda]
     python bench/gpu_check.py --dry-run     (prints the plan and checks it; no GPU needed)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480  # the whole check, every step included
PYTHON = sys.executable


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    limit_s: int  # the most this step may take
    parse: str  # "json": stdout is one JSON value; "text": keep the output's tail


def plan(device: str = "cuda") -> list[Step]:
    cli = [PYTHON, "-m", "personaplex_cli"]
    steps = [Step(f"doctor {quantize}", cli + ["doctor", "--bench", "--size", "full",
                                               "--device", device, "--dtype", "bf16",
                                               "--quantize", quantize, "--frames", "50",
                                               "--json"], 70, "json")
             for quantize in ("none", "int8", "int4", "fp8")]
    steps.append(Step("graphs", [PYTHON, "-m", "pytest", "-q", "-x", "tests/test_graphs.py"],
                      40, "text"))
    steps.append(Step("frame", ["sh", "-c", " && ".join(
        f"{PYTHON} bench/gpu_frame.py --device {device} --frames 300 --modes eager,graphs "
        f"--batch {batch}" for batch in (1, 2, 4, 8, 16, 32, 64))], 90, "text"))
    steps.append(Step("serve", [PYTHON, "bench/serve.py", "--model", "mid", "--device", device,
                                "--callers", "1,8,32,64", "--seconds", "8"], 70, "text"))
    return steps


def check_plan(steps: list[Step]) -> list[str]:
    """What is wrong with the plan, without running any of it: the budget, and every script,
    test file and CLI option it names."""
    problems = []
    total = sum(step.limit_s for step in steps)
    if total > BUDGET_S:
        problems.append(f"the steps' limits add up to {total} s, over {BUDGET_S} s")
    for step in steps:
        words = " ".join(step.command).split()
        for word in words:
            if word.endswith(".py") and not (ROOT / word).exists():
                problems.append(f"{step.name}: {word} does not exist")
        # `pip install .` (the README's install) brings no pytest: a clean checkout's
        # test steps would fail on the GPU, after the budget had started.
        module = words[words.index("-m") + 1] if "-m" in words else None
        if module and importlib.util.find_spec(module) is None:
            problems.append(f"{step.name}: {module} is not installed in {PYTHON} "
                            "(pip install -e '.[test]')")
    helptext = subprocess.run([PYTHON, "-m", "personaplex_cli", "doctor", "--help"],
                              capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, COLUMNS="200")).stdout
    for option in ("--bench", "--size", "--frames", "--device", "--json", "--quantize"):
        if option not in helptext:
            problems.append(f"personaplex doctor has no {option}")
    return problems


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            info["memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    except ImportError:
        info["torch"] = None
    return info


def run_step(step: Step, limit_s: float) -> dict:
    start = time.monotonic()
    try:
        proc = subprocess.run(step.command, capture_output=True, text=True, cwd=ROOT,
                              timeout=limit_s)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return {"status": "timed out", "seconds": round(time.monotonic() - start, 1),
                "output": out[-4000:]}
    result = {"status": "ok" if proc.returncode == 0 else "failed", "rc": proc.returncode,
              "seconds": round(time.monotonic() - start, 1)}
    if step.parse == "json" and proc.returncode == 0:
        try:
            result["result"] = json.loads(proc.stdout)
        except ValueError:
            result["output"] = proc.stdout[-4000:]
    else:
        result["output"] = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode != 0:
        result["stderr"] = proc.stderr[-2000:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and check it, run nothing")
    args = parser.parse_args()
    steps = plan(args.device)
    if args.dry_run:
        for step in steps:
            print(f"{step.limit_s:4d} s  {step.name:12} {' '.join(step.command)}")
        print(f"{sum(s.limit_s for s in steps):4d} s  in all (budget {BUDGET_S} s)")
        problems = check_plan(steps)
        for problem in problems:
            print(f"problem: {problem}")
        raise SystemExit(1 if problems else 0)
    began = time.monotonic()
    report = {"machine": machine(), "budget_s": BUDGET_S, "steps": {}}
    for step in steps:
        left = BUDGET_S - (time.monotonic() - began)
        if left < step.limit_s / 2:
            report["steps"][step.name] = {"status": "skipped", "why": f"{left:.0f} s left"}
        else:
            print(f"{step.name} (up to {min(step.limit_s, left):.0f} s)", flush=True)
            report["steps"][step.name] = run_step(step, min(step.limit_s, left))
        report["seconds"] = round(time.monotonic() - began, 1)
        tmp = args.out.with_suffix(".part")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, args.out)
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
