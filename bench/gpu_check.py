"""Everything the project checks on a GPU, in one command, into one JSON file, in 8 minutes.

For the first time a GPU is lent. Each step runs as its own process with its own time limit
inside a total of BUDGET_S: a step that would not fit in what is left is recorded as
skipped, one that fails or runs out of time with its exit status and the tail of its
output, and the file is written after every step, so a run cut short keeps what it measured.
The 7B is built once per precision, in one process, and measured there.

  agree     `personaplex doctor --bench --size tiny --json` on cuda: one seeded tiny model
            run on the CPU, on cuda eager and on cuda with CUDA graphs, teacher-forced,
            through a primed persona, a cached join and a join into a reused row (agree, or
            the first frame, row and stream that differ), and the tiny model's frame times;
  refusals  this script's --refusals: model/precision.py's decision for this GPU, torch and
            CUDA, every dtype and quantization, beside what each quantized kernel does at
            every linear shape of the 7B (a case admitted must run);
  cli       this script's --cli: encode, decode and reply through the console script on cuda
            and on the CPU, on the golden tiny checkpoints (tests/data/golden): reply's
            greedy fp32 tokens against NVIDIA's golden ones, encode's codes and decode's
            audio against the CPU's;
  cuda:1    the agreement check on the second GPU, while cuda:0 is current (skipped with
            one GPU);
  tests     tests/test_graphs.py's CUDA tests: graphs against eager on the first and the
            last GPU;
  7b        this script's --seven-b: the 7B with random weights, bf16, int8, int4 and fp8 in
            turn (a precision refused here is recorded as refused), each freed before the
            next: one stream's peak memory against the count and the README's card size,
            graphs against eager over 20 greedy frames and their frame times; with bf16 the
            live-count graphs at 1, 8, 32 and 64 callers against eager steps.

The time budget, by arithmetic, on an H200 (a process's start, torch's import and CUDA's
initialisation taken as 10 s; a 7B step as at most 100 ms, eager, at 64 rows), each step's
limit first:
  agree     limit  40: 10 start + 3 builds of the tiny model and 2 captures (6 graphs) +
            3 x 24 frames of a tiny model (Python-bound, ~10 ms each): about 20 s
  refusals  limit  30: 10 start + 72 quantizations of a 7B linear (8 shapes x 3 modes x 3
            dtypes) on the GPU, ~0.1 s each: about 20 s
  cli       limit  50: 5 console-script runs (cuda and cpu), 6-8 s each: about 40 s
  cuda:1    limit  40: as agree
  tests     limit  60: 10 start + 2 x (a tiny model's 30 frames eager and graphed): 20 s
  7b        limit 240: 10 start; per precision the 7B built with random weights on the
            device (bf16 ~5 s; int8, int4, fp8 quantized tensor by tensor ~15 s), one
            stream primed (14 frames) and 21 frames, graphed (6 captures x 3 runs) and
            eager: ~10 s; so ~15 s bf16 and ~25 s each other: 90 s; bf16's live counts:
            64 rows' graphs captured (34 graphs x 3 runs of at most 0.1 s: 10 s), 64 joins
            from the cache, 4 counts x 21 steps graphed and eager (at most 0.1 s each:
            17 s): about 30 s; about 130 s in all
  in all    460 s of BUDGET_S = 480.

Run: python bench/gpu_check.py [--out gpu_check.json] [--device cuda]
     python bench/gpu_check.py --dry-run    (no GPU: checks the plan, then rehearses the
                                             --refusals, --cli and --seven-b code on the
                                             CPU with the tiny model, in seconds)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480  # the whole check, every step included
PYTHON = sys.executable
GOLDEN = ROOT / "tests" / "data" / "golden"
ASSETS = GOLDEN / "assets"
SEVEN_B_FRAMES = 20
LIVE_COUNTS = (1, 8, 32, 64)
# The card each precision's one stream is said to fit (README, "Requirements"), in GiB.
CARD_GIB = {"none": 24, "int8": 16, "int4": 12}


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    limit_s: int  # the most this step may take
    parse: str  # "json": stdout is one JSON value; "text": keep the output's tail
    needs_gpus: int = 1  # skipped where fewer are visible


def plan(device: str = "cuda") -> list[Step]:
    cli = [PYTHON, "-m", "personaplex_cli"]
    here = [PYTHON, "bench/gpu_check.py", "--device", device]
    agree = cli + ["doctor", "--bench", "--size", "tiny", "--frames", "10", "--json"]
    return [
        Step("agree", agree + ["--device", device], 40, "json"),
        Step("refusals", here + ["--refusals"], 30, "json"),
        Step("cli", here + ["--cli"], 50, "json"),
        Step("cuda:1", agree + ["--device", "cuda:1"], 40, "json", needs_gpus=2),
        Step("tests", [PYTHON, "-m", "pytest", "-q", "-x", "tests/test_graphs.py", "-k",
                       "graph_replay_equals_eager"], 60, "text"),
        Step("7b", here + ["--seven-b"], 240, "json"),
    ]


def check_plan(steps: list[Step]) -> list[str]:
    """What is wrong with the plan, without running any of it: the budget, and every script,
    test file, module, data file and CLI option it names."""
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
    for needed in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                   "tokenizer_spm_tiny_512.model", "personaplex-arch.json", "input.wav",
                   "voice_prompt.wav"):
        if not (ASSETS / needed).exists():
            problems.append(f"cli: the golden checkpoints' {needed} is not in {ASSETS}")
    helptext = subprocess.run([PYTHON, "-m", "personaplex_cli", "doctor", "--help"],
                              capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, COLUMNS="200")).stdout
    for option in ("--bench", "--size", "--frames", "--device", "--json", "--graphs"):
        if option not in helptext:
            problems.append(f"personaplex doctor has no {option}")
    return problems


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpus"] = [{"name": torch.cuda.get_device_name(i),
                             "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                             "memory_gib": torch.cuda.get_device_properties(i).total_memory
                             / 2 ** 30} for i in range(torch.cuda.device_count())]
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
    if step.parse == "json" and proc.stdout.strip():
        try:
            result["result"] = json.loads(proc.stdout)
        except ValueError:
            result["output"] = proc.stdout[-4000:]
    else:
        result["output"] = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode != 0:
        result["stderr"] = proc.stderr[-2000:]
    return result


# -- --refusals ---------------------------------------------------------------------------------

def seven_b_shapes() -> list[tuple[int, int]]:
    from personaplex_cli.core.config import Arch
    from personaplex_cli.core.lm import LMModel
    from personaplex_cli.core.quantize import quantized_linears
    from personaplex_cli.model.skeleton import shapes_only

    with shapes_only():
        lm = LMModel(Arch().lm, 8)
    return sorted({(lm.get_submodule(n).out_features, lm.get_submodule(n).in_features)
                   for n in quantized_linears(lm)})


def refusals(device_name: str, shapes: list[tuple[int, int]] | None = None) -> dict:
    """The decision for this device, and each kernel run at each shape: {cases: [...]}."""
    import torch

    from personaplex_cli.core.quantize import QUANTIZED_LINEAR
    from personaplex_cli.model.device import DTYPES, resolve_device, where
    from personaplex_cli.model.precision import precision_problem

    device = resolve_device(device_name)
    here = where(device)
    cases = []
    for quantize, cls in QUANTIZED_LINEAR.items():
        for name, dtype in DTYPES.items():
            problem = precision_problem(here, name, quantize)
            error = None
            try:
                for out_features, in_features in shapes or seven_b_shapes():
                    linear = torch.nn.Linear(in_features, out_features, bias=False,
                                             device=device, dtype=dtype)
                    y = cls.from_linear(linear, dtype)(torch.randn(2, in_features,
                                                                   device=device, dtype=dtype))
                    assert y.shape == (2, out_features) and torch.isfinite(y).all()
                    del linear, y
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as failure:  # what the refusal is there to spare a user
                error = f"{type(failure).__name__}: {str(failure).splitlines()[0][:200]}"
            cases.append({"quantize": quantize, "dtype": name, "refused": problem,
                          "ran": error is None, "error": error,
                          "admitted_but_failed": problem is None and error is not None})
    return {"where": asdict(here), "cases": cases,
            "every_admitted_case_ran": not any(c["admitted_but_failed"] for c in cases)}


# -- --cli ----------------------------------------------------------------------------------------

def golden_model(folder: Path) -> Path:
    """The golden tiny checkpoints as a model folder (as tests/conftest.py makes it)."""
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                 "tokenizer_spm_tiny_512.model"):
        (folder / name).symlink_to(ASSETS / name)
    shutil.copy(ASSETS / "personaplex-arch.json", folder / "personaplex-arch.json")
    return folder


def cli_runs(device_name: str) -> dict:
    import numpy as np
    import soundfile as sf

    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = dict(os.environ, PERSONAPLEX_MODEL=str(golden_model(work / "model")))

        def cli(*args) -> dict:
            began = time.monotonic()
            proc = subprocess.run([PYTHON, "-m", "personaplex_cli", *map(str, args)],
                                  capture_output=True, text=True, env=env, cwd=ROOT)
            return {"rc": proc.returncode, "seconds": round(time.monotonic() - began, 1),
                    "stderr": proc.stderr[-1000:]}

        # On the CPU (the dry run's rehearsal) the CPU's own runs are the device's.
        runs = {"device": device_name, "cpu": "cpu"} if device_name != "cpu" else {
            "device": "cpu"}
        for label, device in runs.items():
            result[f"encode {label}"] = cli("encode", ASSETS / "input.wav", "-o",
                                            work / f"{label}.mimi", "--device", device)
            result[f"decode {label}"] = cli("decode", work / f"{label}.mimi", "-o",
                                            work / f"{label}.wav", "--device", device,
                                            "--sample-format", "f32")
        labels = ["device", "cpu" if "cpu" in runs else "device"]
        codes = [(work / f"{label}.mimi").read_bytes() if (work / f"{label}.mimi").exists()
                 else None for label in labels]
        result["encode_codes_equal_cpu"] = codes[0] is not None and codes[0] == codes[1]
        audio = [sf.read(work / f"{label}.wav")[0] for label in labels
                 if (work / f"{label}.wav").exists()]
        if len(audio) == 2:
            result["decode_max_abs_diff_cpu"] = float(np.abs(audio[0] - audio[1]).max())
        result["reply device"] = cli(
            "reply", ASSETS / "input.wav", work / "reply.wav", "--voice",
            ASSETS / "voice_prompt.wav", "--greedy", "--dtype", "fp32", "--device",
            device_name, "--codes-out", work / "codes.npy")
        if (work / "codes.npy").exists():
            want = np.load(GOLDEN / "fp32_wav_greedy" / "tokens.npy")[1:9]
            result["reply_codes_equal_nvidias"] = bool(np.array_equal(
                np.load(work / "codes.npy"), want))
    return result


# -- --seven-b ------------------------------------------------------------------------------------

def _step_ms(scheduler, pcm, frames: int) -> tuple[list, float]:
    """Steps `frames` + 1 frames (the first not timed) -> (each frame's tokens, p50 ms)."""
    import torch

    from personaplex_cli.runtime.warmup import percentile_ms

    tokens, times = [], []
    for t in range(frames + 1):
        began = time.perf_counter()
        frame = scheduler.step(pcm[t % len(pcm)].numpy())  # host copies: the step has ended
        times.append(1000 * (time.perf_counter() - began))
        tokens.append(torch.from_numpy(frame.tokens))
    return torch.stack(tokens), percentile_ms(times[1:], 0.5)


def seven_b(device_name: str, size: str = "full", frames: int = SEVEN_B_FRAMES,
            live_counts: tuple[int, ...] = LIVE_COUNTS) -> dict:
    """The 7B (`size`: doctor --bench's) per precision, built once and measured there."""
    import torch

    from personaplex_cli.core.config import FRAME_SIZE
    from personaplex_cli.core.sampling import Sampling
    from personaplex_cli.doctor.bench import (PERSONA, BenchModel, bench_arch, peak_bytes,
                                              random_mimi, random_source, reset_peak)
    from personaplex_cli.runtime.scheduler import Scheduler
    from personaplex_cli.model.device import quantize_problem, resolve_device
    from personaplex_cli.model.load import build_lm
    from personaplex_cli.model.memory import (GIB, default_dep_steps, memory_need,
                                              release_free_memory)

    device = resolve_device(device_name)
    arch = bench_arch(size)
    dep_steps = default_dep_steps(arch.lm)
    dtype = torch.bfloat16
    greedy = Sampling(greedy=True)
    pcm = (0.1 * torch.randn(frames + 1, max(live_counts), FRAME_SIZE,
                             generator=torch.Generator().manual_seed(1)))
    out: dict = {}
    for quantize in ("none", "int8", "int4", "fp8"):
        problem = quantize_problem(device, quantize, dtype)
        if problem:
            out[quantize] = {"refused": problem}
            continue
        release_free_memory()
        reset_peak(device)
        began = time.monotonic()
        lm = build_lm(arch.lm, dep_steps, device, dtype, quantize,
                      random_source(arch.lm, device, dtype, seed=0))
        mimi = random_mimi(arch, device, seed=0)
        result = {"load_s": round(time.monotonic() - began, 1)}
        runs = {}
        for graphs in (True, False):
            reset_peak(device)
            model = BenchModel(arch, device, dtype, quantize, mimi=mimi, lm=lm)
            slots = Scheduler.for_model(model, 1, graphs=graphs if device.type == "cuda"
                                        else False)
            slots.join(PERSONA, greedy, 0)
            tokens, p50 = _step_ms(slots, pcm[:, :1], frames)
            runs[graphs] = tokens
            result[f"frame_ms_p50_{'graphs' if graphs else 'eager'}"] = p50
            if graphs:  # one stream as reply and talk run it
                need = memory_need(arch, arch.lm, dep_steps, device, dtype, quantize)
                peak = peak_bytes(device)
                result.update(one_stream_peak_gib=peak / GIB, count_gib=need.total / GIB,
                              peak_of_count=peak / need.total)
                if quantize in CARD_GIB and size == "full":
                    result["fits_readme_card"] = {f"{CARD_GIB[quantize]} GiB":
                                                  peak <= CARD_GIB[quantize] * GIB}
                result["graphs_fallback"] = slots.graphs_fallback
            del slots
            release_free_memory()
        differ = (runs[True] != runs[False]).any(dim=(1, 2)).nonzero()
        result["graphs_vs_eager"] = ("tokens equal" if not len(differ) else
                                     f"tokens differ from frame {int(differ[0])}")
        if quantize == "none":
            result["live_counts_ms"] = live_count_costs(
                BenchModel(arch, device, dtype, quantize, mimi=mimi, lm=lm), pcm, frames,
                live_counts, device)
        out[quantize] = result
        del lm, mimi
        gc.collect()
        release_free_memory()
    return out


def live_count_costs(model, pcm, frames: int, counts: tuple[int, ...], device) -> dict:
    """Step p50 at each live count in a batch of max(counts) rows, graphs then eager."""
    from personaplex_cli.core.sampling import Sampling
    from personaplex_cli.doctor.bench import PERSONA
    from personaplex_cli.model.memory import release_free_memory
    from personaplex_cli.runtime.scheduler import Scheduler

    costs: dict = {}
    for graphs in ((True, False) if device.type == "cuda" else (False,)):
        slots = Scheduler.for_model(model, max(counts), graphs=graphs)
        for live in counts:
            while len(slots.live()) < live:
                slots.join(PERSONA, Sampling(greedy=True), len(slots.live()))
            _, p50 = _step_ms(slots, pcm, frames)
            costs[f"{live} {'graphs' if graphs else 'eager'}"] = p50
        del slots
        release_free_memory()
    return costs


# -- the run ---------------------------------------------------------------------------------------

def rehearse() -> list[str]:
    """The in-process steps on the CPU with the tiny model, as the GPU will run them at the
    real size: what fails here would fail there, after the budget had started."""
    problems = []
    for name, call in (
            ("refusals", lambda: refusals("cpu", [(64, 64)])),
            ("7b", lambda: seven_b("cpu", "tiny", frames=2, live_counts=(1, 2))),
            ("cli", lambda: cli_runs("cpu"))):
        try:
            result = call()
        except Exception as error:  # noqa: BLE001 - reported, as the GPU run would
            problems.append(f"{name} rehearsed on the CPU: {type(error).__name__}: {error}")
            continue
        print(f"rehearsed {name} on the CPU: {json.dumps(result)[:300]}")
        failed = [run for run, value in result.items() if isinstance(value, dict)
                  and value.get("rc", 0) != 0]
        if name == "cli" and (failed or not result.get("reply_codes_equal_nvidias")):
            problems.append(f"cli rehearsed on the CPU: {json.dumps(result)[:500]}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the plan and rehearse its code on the CPU; no GPU")
    parser.add_argument("--refusals", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cli", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seven-b", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag, step in (("refusals", refusals), ("cli", cli_runs), ("seven_b", seven_b)):
        if getattr(args, flag):
            print(json.dumps(step(args.device)))
            return
    steps = plan(args.device)
    if args.dry_run:
        for step in steps:
            print(f"{step.limit_s:4d} s  {step.name:9} {' '.join(step.command)}")
        print(f"{sum(s.limit_s for s in steps):4d} s  in all (budget {BUDGET_S} s)")
        problems = check_plan(steps)
        problems += rehearse() if not problems else []
        for problem in problems:
            print(f"problem: {problem}")
        raise SystemExit(1 if problems else 0)
    began = time.monotonic()
    report = {"machine": machine(), "budget_s": BUDGET_S, "steps": {}}
    gpus = len(report["machine"].get("gpus", []))
    for step in steps:
        left = BUDGET_S - (time.monotonic() - began)
        if gpus < step.needs_gpus:
            report["steps"][step.name] = {"status": "skipped",
                                          "why": f"{gpus} GPU(s), needs {step.needs_gpus}"}
        elif left < step.limit_s / 2:
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
