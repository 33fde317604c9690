"""The per-frame LM step: ours against Kyutai's reference `LMGen.step` (moshi 0.2.13).

Both run on the same random weights in one process, sampling on, fp32 on CPU (bf16 with
--dtype bf16), text_card 32000, card 2048, n_q 16, context 3000. Two shapes of depformer:
  dep_q 8   Moshiko-shaped: both run 8 depformer steps (the same work);
  dep_q 16  PersonaPlex-shaped: the reference runs all 16 steps (it has no way to take the
            caller's codes then), we run the 8 that produce output, as `reply`/`talk` do.
Prints median ms per frame and the ratio ours / reference (the goal is <= 0.6). In fp32 we
attend only over the KV slots written so far; the reference always attends over the whole
3000-slot ring. So we also time ours with the window already full (after 240 s of
conversation), where that saving is gone: "full" and its ratio.

Run: python bench/lm_step.py [--frames N] [--threads T] [--dtype fp32|bf16]
Needs the test extra and `pip install --no-deps moshi==0.2.13`.
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
import reference  # noqa: E402
from real_size import fill_window  # noqa: E402  (bench/ is the script's folder)

from personaplex_cli.core.generator import FrameGenerator  # noqa: E402
from personaplex_cli.core.sampling import Sampling  # noqa: E402
from personaplex_cli.model.files import ModelDir  # noqa: E402
from personaplex_cli.model.load import load_lm  # noqa: E402

SIZES = {
    "dim 512 x4, dep 256 x4": dict(dim=512, num_heads=8, num_layers=4, depformer_dim=256,
                                   depformer_num_heads=4, depformer_num_layers=4,
                                   depformer_dim_feedforward=int(4.125 * 256)),
    "dim 1024 x8, dep 512 x6": dict(dim=1024, num_heads=16, num_layers=8, depformer_dim=512,
                                    depformer_num_heads=8, depformer_num_layers=6,
                                    depformer_dim_feedforward=int(4.125 * 512)),
}


def median_ms(step, frames: int, warmup: int) -> float:
    for t in range(warmup):
        step(t)
    times = []
    for t in range(warmup, warmup + frames):
        start = time.perf_counter()
        step(t)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def measure(size: dict, dep_q: int, dtype: torch.dtype, frames: int
            ) -> tuple[float, float, float]:
    from moshi.models.lm import LMGen

    kwargs = reference.tiny_lm_kwargs(text_card=32000, context=3000, dep_q=dep_q, **size)
    with tempfile.TemporaryDirectory() as tmp:
        ref = reference.build_lm(Path(tmp), kwargs, seed=0, dtype=dtype)
        ours = load_lm(ModelDir(Path(tmp), "bench"), torch.device("cpu"), dtype, dep_steps=8)
    user = torch.randint(0, 2048, (frames + 10, 8))

    ref_gen = LMGen(ref, use_sampling=True)
    with ref_gen.streaming(1):
        needed = 16 - dep_q
        ref_ms = median_ms(lambda t: ref_gen.step(user[t, :needed].view(1, -1, 1)), frames, 5)
    gen = FrameGenerator(ours, Sampling(), generator=torch.Generator().manual_seed(0))
    ours_ms = median_ms(lambda t: gen.step(user=user[t][None]), frames, 5)
    fill_window(gen)
    full_ms = median_ms(lambda t: gen.step(user=user[t][None]), frames, 2)
    return ours_ms, full_ms, ref_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    print(f"LM step, random weights, CPU, {args.threads} threads, {args.dtype}, "
          f"torch {torch.__version__}, median of {args.frames} frames")
    print(f"{'size':26} {'dep_q':>5} {'ours ms':>8} {'full ms':>8} {'ref ms':>8} {'ratio':>7} "
          f"{'full':>6}")
    for name, size in SIZES.items():
        for dep_q in (8, 16):
            ours_ms, full_ms, ref_ms = measure(size, dep_q, dtype, args.frames)
            print(f"{name:26} {dep_q:5} {ours_ms:8.2f} {full_ms:8.2f} {ref_ms:8.2f} "
                  f"{ours_ms / ref_ms:6.2f}x {full_ms / ref_ms:5.2f}x")


if __name__ == "__main__":
    main()
