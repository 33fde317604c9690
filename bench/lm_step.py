"""The per-frame LM step: ours against Kyutai's reference `LMGen.step` (moshi 0.2.13).

Both run on the same random weights in one process, sampling on, fp32 on CPU (bf16 with
--dtype bf16), text_card 32000, card 2048, n_q 16, context 3000. Two shapes of depformer:
  dep_q 8   Moshiko-shaped: both run 8 depformer steps (the same work);
  dep_q 16  PersonaPlex-shaped: the reference runs all 16 steps (it has no way to take the
            caller's codes then), we run the 8 that produce output, as `reply`/`talk` do.
Prints median ms per frame and the ratio ours / reference (the goal is <= 0.6). The two step
in turn, frame by frame, so a busy machine slows both alike. In fp32 we attend only over the
KV slots written so far; the reference always attends over the whole 3000-slot ring. So we
also time ours with the window already full (after 240 s of conversation), where that saving
is gone: "full" and its ratio. `--batch B` steps B streams at once (both sides);
`--profile` prints where our step spends its time instead; `--layouts` times each of the
LM's linear shapes with its weight stored [out, in] (nn.Linear) and [in, out] (what
model/device.py's wide_linears_input_major picks on the CPU in fp32 for outputs wider than
inputs), from a pool of weights larger than the caches, as a frame reads them.

Run: python bench/lm_step.py [--frames N] [--threads T] [--dtype fp32|bf16] [--batch B]
     [--profile | --layouts]
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
from personaplex_cli.core.graphs import make_generator  # noqa: E402
from personaplex_cli.core.sampling import Sampling  # noqa: E402
from personaplex_cli.model.files import ModelDir  # noqa: E402
from personaplex_cli.model.load import load_lm  # noqa: E402

SIZES = {
    "512x4": dict(dim=512, num_heads=8, num_layers=4, depformer_dim=256,
                                   depformer_num_heads=4, depformer_num_layers=4,
                                   depformer_dim_feedforward=int(4.125 * 256)),
    "1024x8": dict(dim=1024, num_heads=16, num_layers=8, depformer_dim=512,
                                    depformer_num_heads=8, depformer_num_layers=6,
                                    depformer_dim_feedforward=int(4.125 * 512)),
}


def interleaved_ms(steps, frames: int, warmup: int) -> list[float]:
    """Median ms per call of each of `steps`, called in turn frame by frame."""
    for t in range(warmup):
        for step in steps:
            step(t)
    times = [[] for _ in steps]
    for t in range(warmup, warmup + frames):
        for step, spent in zip(steps, times):
            start = time.perf_counter()
            step(t)
            spent.append(time.perf_counter() - start)
    return [1000 * statistics.median(spent) for spent in times]


def build(size: dict, dep_q: int, dtype: torch.dtype, batch: int):
    kwargs = reference.tiny_lm_kwargs(text_card=32000, context=3000, dep_q=dep_q, **size)
    with tempfile.TemporaryDirectory() as tmp:
        ref = reference.build_lm(Path(tmp), kwargs, seed=0, dtype=dtype)
        ours = load_lm(ModelDir(Path(tmp), "bench"), torch.device("cpu"), dtype, dep_steps=8)
    gen = make_generator(ours, batch)
    for row in range(batch):
        gen.set_sampling(row, Sampling(), torch.Generator().manual_seed(row))
    return ref, gen


@torch.no_grad()
def measure(size: dict, dep_q: int, dtype: torch.dtype, frames: int, batch: int
            ) -> tuple[float, float, float]:
    from moshi.models.lm import LMGen

    ref, gen = build(size, dep_q, dtype, batch)
    user = torch.randint(0, 2048, (frames + 10, 8))
    needed = 16 - dep_q
    ref_gen = LMGen(ref, use_sampling=True)
    with ref_gen.streaming(batch):
        def ref_step(t):
            ref_gen.step(user[t, :needed].view(1, -1, 1).expand(batch, -1, -1))

        def our_step(t):
            gen.step(user=user[t][None].expand(batch, -1))

        ours_ms, ref_ms = interleaved_ms([our_step, ref_step], frames, 5)
        fill_window(gen)
        full_ms, _ = interleaved_ms([our_step, ref_step], frames, 2)
    return ours_ms, full_ms, ref_ms


@torch.no_grad()
def profile(size: dict, dtype: torch.dtype, batch: int, frames: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    _, gen = build(size, 16, dtype, batch)
    user = torch.randint(0, 2048, (frames + 5, 8))
    for t in range(5):
        gen.step(user=user[t][None].expand(batch, -1))
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for t in range(5, 5 + frames):
            gen.step(user=user[t][None].expand(batch, -1))
    print(f"\nbatch {batch}: {frames} steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


@torch.no_grad()
def layouts(size: dict, dtype: torch.dtype, batch: int) -> None:
    import torch.nn.functional as F

    _, gen = build(size, 8, torch.float32, 1)
    shapes = sorted({(m.in_features, m.out_features) for m in gen.lm.modules()
                     if hasattr(m, "in_features") and hasattr(m, "out_features")})
    print(f"{'in -> out':>14} {'[out,in] us':>12} {'[in,out] us':>12} {'ratio':>6}")
    for fan_in, fan_out in shapes:
        pool = max(2, int(256e6 // (fan_in * fan_out * 4)))  # > the caches: read from memory
        weights = [torch.randn(fan_out, fan_in).to(dtype) for _ in range(pool)]
        transposed = [w.t().contiguous() for w in weights]
        x = torch.randn(batch, 1, fan_in).to(dtype)
        timed = []
        for call in (lambda k: F.linear(x, weights[k]), lambda k: torch.matmul(x, transposed[k])):
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for k in range(pool):
                    call(k)
                best = min(best, (time.perf_counter() - start) / pool)
            timed.append(best * 1e6)
        print(f"{fan_in:6} -> {fan_out:5} {timed[0]:12.0f} {timed[1]:12.0f} "
              f"{timed[1] / timed[0]:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help="which sizes: 512x4 (depformer 256 x 4), 1024x8 (512 x 6)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--layouts", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    sizes = {name: SIZES[name] for name in args.sizes.split(",")}
    if args.profile:
        for name, size in sizes.items():
            print(name)
            profile(size, dtype, args.batch)
        return
    if args.layouts:
        for name, size in sizes.items():
            print(f"{name}, {args.dtype}, batch {args.batch}, {args.threads} threads")
            layouts(size, dtype, args.batch)
        return
    print(f"LM step, random weights, CPU, {args.threads} threads, {args.dtype}, batch "
          f"{args.batch}, torch {torch.__version__}, median of {args.frames} frames")
    print(f"{'size (dim x layers)':20} {'dep_q':>5} {'ours ms':>8} {'full ms':>8} {'ref ms':>8} {'ratio':>7} "
          f"{'full':>6}")
    for name, size in sizes.items():
        for dep_q in (8, 16):
            ours_ms, full_ms, ref_ms = measure(size, dep_q, dtype, args.frames, args.batch)
            print(f"{name:20} {dep_q:5} {ours_ms:8.2f} {full_ms:8.2f} {ref_ms:8.2f} "
                  f"{ours_ms / ref_ms:6.2f}x {full_ms / ref_ms:5.2f}x")


if __name__ == "__main__":
    main()
