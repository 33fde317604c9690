"""What a step costs with few rows live in a wide batch: the live prefix against the whole
capacity, side by side (the two step in turn, frame by frame, so a busy machine slows both
alike).

The golden tiny model (tests/data/golden), fp32 on the CPU, a batch of --capacity rows of
which 1, 4, ... are live (joined with one persona). "prefix" is what the runtime's
Scheduler.step does (only the rows up to the last live one); "whole" steps every row of the
capacity, as before.
Prints median ms per step and the ratio prefix / whole.

Run: python bench/live_rows.py [--capacity 64] [--live 1,4,16] [--frames 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import golden_model_folder  # noqa: E402

from personaplex_cli.prompts.persona import Persona, prepare_persona  # noqa: E402
from personaplex_cli.core.sampling import Sampling  # noqa: E402
from personaplex_cli.model.files import ModelDir  # noqa: E402
from personaplex_cli.model.model import Model  # noqa: E402
from personaplex_cli.runtime.scheduler import Scheduler  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--live", default="1,4,16")
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = golden_model_folder(Path(tempfile.mkdtemp()) / "model")
    model = Model(ModelDir(folder, "golden"), torch.device("cpu"), torch.float32)
    prompt = prepare_persona(model, Persona(None, "Be brief."))
    slots = Scheduler.for_model(model, args.capacity)
    session = slots.session
    silence = torch.zeros(args.capacity, 1920)
    print(f"capacity {args.capacity}, {args.threads} thread(s), {args.frames} frames each")
    for live in map(int, args.live.split(",")):
        while len(slots.live()) < live:
            slots.join(prompt, Sampling(), len(slots.live()))
        rows = slots.live()[-1] + 1
        times: dict[str, list[float]] = {"prefix": [], "whole": []}
        for frame in range(args.frames + 3):
            for name, count in (("prefix", rows), ("whole", args.capacity)):
                began = time.perf_counter()
                session.step(silence, count)
                if frame >= 3:  # the first steps of a shape pay one-off costs
                    times[name].append(1000 * (time.perf_counter() - began))
        prefix, whole = (statistics.median(times[n]) for n in ("prefix", "whole"))
        print(f"{live:3d} live: prefix {prefix:7.1f} ms, whole {whole:7.1f} ms, "
              f"ratio {prefix / whole:.2f}")


if __name__ == "__main__":
    main()
