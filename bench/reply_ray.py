"""`reply --manifest` on Ray against the same manifest answered here, side by side.

One manifest of ROWS recordings (speech-like, 2 to 4 s, four personas) is answered by
    local     `personaplex reply --manifest` (one process, continuous batching),
    ray x1    `reply --manifest --ray ADDRESS --workers 1`,
    ray x2    `reply --manifest --ray ADDRESS --workers 2`,
each as a whole command (its start-up, the model's load, the answers, the files written),
on a Ray cluster of this machine started once beforehand (its start-up is printed apart:
`--ray local` pays it on every run). The rounds alternate the three, and the best of each
is kept, as the machine may be shared. It prints rows per second, the ratios against the
local run, and Ray's overhead per row and per run: (ray x1 - local) over the rows.

The model is the tests' tiny checkpoint (tests/data/golden): its steps cost almost nothing,
so what is measured is what Ray adds (starting the actors, loading the model in each,
handing rows over, reporting), not the model. With one GPU per actor and the real model,
a row of a few seconds costs seconds of GPU time, so that overhead is a small part of it,
and N actors on N GPUs scale the rows per second by up to N; here two actors share the
same CPUs, so x2 cannot beat x1 by much.

Run: python bench/reply_ray.py [--rows 24] [--rounds 2] [--batch-size 4] [--threads 1]
Needs the ray extra (`pip install -e '.[ray]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import soundfile as sf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import golden_model_folder, speech_like  # noqa: E402

PERSONAS = [{"voice": "NATF2"}, {"voice": "NATF2", "prompt": "You are a pirate."},
            {"voice": ""}, {"prompt": "Be brief."}]


def manifest(root: Path, rows: int, out: str) -> Path:
    (root / out).mkdir(exist_ok=True)
    path = root / f"{out}.jsonl"
    path.write_text("".join(json.dumps({"input": f"in/{i}.wav", "output": f"{out}/{i}.wav",
                                        **PERSONAS[i % 4]}) + "\n" for i in range(rows)))
    return path


def timed(command: list[str], env: dict, cwd: Path) -> float:
    began = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr.decode()}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each command and worker (OMP_NUM_THREADS)")
    args = parser.parse_args()
    # One thread each by default: on a machine other work keeps busy, OpenMP threads that
    # wait for each other spin, and two of them on two loaded cores ran this model 10x
    # slower than one (8 against 84 frames/s, measured), which would measure the machine's
    # load, not Ray. The workers compute with the command's thread count (its bytes).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # 127.0.0.1 only
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    import ray

    with tempfile.TemporaryDirectory(prefix="ray-bench-", dir="/tmp") as temp:
        root = Path(temp)
        model = golden_model_folder(root / "model")
        (root / "in").mkdir()
        for i in range(args.rows):
            sf.write(root / "in" / f"{i}.wav", speech_like(2.0 + (i % 3), 24000, i), 24000,
                     subtype="PCM_16")
        began = time.perf_counter()
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 _temp_dir=str(root / "ray"))
        cluster_s = time.perf_counter() - began
        address = ray.get_runtime_context().gcs_address
        env = {**os.environ, "PERSONAPLEX_MODEL": str(model), "PERSONAPLEX_DEVICE": "cpu",
               "PYTHONPATH": str(ROOT)}
        base = [sys.executable, "-m", "personaplex_cli", "reply", "-q", "--seed", "1",
                "-b", str(args.batch_size), "--force"]
        runs = {"local": [], "ray x1": [], "ray x2": []}
        for _ in range(args.rounds):
            runs["local"].append(timed(base + ["--manifest", manifest(root, args.rows, "local")],
                                       env, root))
            for workers in (1, 2):
                name = f"ray x{workers}"
                runs[name].append(timed(base + ["--manifest", manifest(root, args.rows, name[-2:]),
                                                "--ray", address, "--workers", str(workers)],
                                        env, root))
        ray.shutdown()
    best = {name: min(times) for name, times in runs.items()}
    print(f"{args.rows} rows of 2-4 s, 4 personas, -b {args.batch_size}, tiny model, "
          f"{args.threads} thread(s) per process, {os.cpu_count()} CPUs (shared: other work "
          f"runs on this machine); best of "
          f"{args.rounds} rounds, each a whole command")
    print(f"Ray cluster start (once, not in the runs below): {cluster_s:.1f} s")
    for name, seconds in best.items():
        print(f"  {name:7s} {seconds:6.1f} s  {args.rows / seconds:6.2f} rows/s  "
              f"x{best['local'] / seconds:.2f} of local   (all: "
              f"{', '.join(f'{t:.1f}' for t in runs[name])} s)")
    overhead = best["ray x1"] - best["local"]
    print(f"Ray's overhead, x1 against local: {overhead:+.1f} s per run, "
          f"{overhead / args.rows:+.2f} s per row over {args.rows} rows")


if __name__ == "__main__":
    main()
