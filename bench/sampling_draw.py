"""One frame's sampling noise for B rows: the reference's per-row generators (today's
`reply`/`talk`/`serve` before counter-based noise, and still a saved generator state's way)
against keyed rows (one batched computation for the whole batch).

For B = 1, 8 and 64 rows of NVIDIA's default sampling (text top-k 25, audio top-k 250,
8 depformer steps, vocabularies 32000 and 2048): the operations launched per frame (each a
kernel launch on a GPU, counted with a dispatch mode) and the median time of one draw, both
kinds in turn in one run so a busy machine slows them alike, and their ratio.

Run: python bench/sampling_draw.py [--device cpu|cuda] [--repeats N] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from personaplex_cli.core.sampling import RowSampling, Sampling, noise_key

VOCAB = (32000, 2048)
DEP_STEPS = 8


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def rows(batch: int, device: torch.device, keyed: bool) -> tuple[RowSampling, torch.Tensor]:
    sampling = RowSampling(batch, device, VOCAB, DEP_STEPS)
    for row in range(batch):
        seed = 1000 + row
        rng = noise_key(seed) if keyed else torch.Generator(device).manual_seed(seed)
        sampling.set(row, Sampling(), rng)
    offsets = torch.arange(1, batch + 1, device=device) * 7
    return sampling, offsets


def draw(sampling: RowSampling, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One frame's noise, as FrameGenerator makes it."""
    return sampling.with_keyed(offsets, *sampling.draw_generators())


def timed(sampling: RowSampling, offsets: torch.Tensor, device: torch.device) -> float:
    began = time.perf_counter()
    draw(sampling, offsets)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{device}, {torch.get_num_threads()} threads, {args.repeats} draws each")
    print(f"{'B':>4} {'ops/frame gen':>14} {'ops/frame keyed':>16} {'ms gen':>9} "
          f"{'ms keyed':>9} {'keyed/gen':>10}")
    for batch in (1, 8, 64):
        kinds = {keyed: rows(batch, device, keyed) for keyed in (False, True)}
        ops = {}
        for keyed, (sampling, offsets) in kinds.items():
            draw(sampling, offsets)  # allocations, first-call costs
            with CountOps() as counter:
                draw(sampling, offsets)
            ops[keyed] = counter.count
        times = {False: [], True: []}
        for _ in range(args.repeats):
            for keyed, (sampling, offsets) in kinds.items():
                times[keyed].append(timed(sampling, offsets, device))
        ms = {keyed: 1000 * statistics.median(t) for keyed, t in times.items()}
        print(f"{batch:>4} {ops[False]:>14} {ops[True]:>16} {ms[False]:>9.3f} {ms[True]:>9.3f} "
              f"{ms[True] / ms[False]:>10.2f}")


if __name__ == "__main__":
    main()
