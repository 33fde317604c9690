"""Offline reply throughput through the code path `personaplex reply` runs (the runtime's
Scheduler: Mimi encode, LM step, Mimi decode), on a mid-size random model.

Three measurements, each side by side in one run:
  step      the median time of one batched step at batch 1, 4 and 16, and the stream-frames
            per second against batch 1;
  mixed     32 recordings of 2 to 30 s in a batch of 8: continuous batching (a row that ends
            takes the next recording at once, the longest first: what `reply` does) against
            lockstep groups of 8 in input order (each group waits for its longest
            recording, what `reply` did before), both on the same engine; the ratio of
            their throughputs (goal >= 1.5x), and of their step counts, which the
            machine's load does not change;
  priming   a newcomer primed while the other rows talk, a few priming steps after each
            frame: the longest tick (step + priming) against the median step of those rows.

The model: the full-size Mimi and an LM of dim 1024 x 8 layers with a 512 x 6 depformer
(PersonaPlex's structure, 16 depformer steps in the checkpoint, the 8 assistant steps run; a
512-token text vocabulary, the tests' tokenizer), built with Kyutai's reference and saved in
the published layout. `--small` uses dim 512 x 4 for a quicker run.

Run: python bench/reply.py [--threads T] [--device cpu|cuda] [--dtype ...] [--small]
     [--only step,mixed,priming]
Needs the test extra and `pip install --no-deps moshi==0.2.13`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import reference  # noqa: E402

from personaplex_cli.audio.frames import InputFrames  # noqa: E402
from personaplex_cli.prompts.persona import PersonaPrompt  # noqa: E402
from personaplex_cli.runtime.rows import ReplyRequest, longest_first  # noqa: E402
from personaplex_cli.runtime.scheduler import Scheduler  # noqa: E402
from personaplex_cli.core.sampling import Sampling  # noqa: E402
from personaplex_cli.model.device import resolve_device  # noqa: E402
from personaplex_cli.model.files import ModelDir  # noqa: E402
from personaplex_cli.model.model import Model, resolve_dtype  # noqa: E402

MID_LM = dict(dim=1024, num_heads=16, num_layers=8, depformer_dim=512, depformer_num_heads=8,
              depformer_num_layers=6, depformer_dim_feedforward=int(4.125 * 512),
              text_card=512)  # the golden tiny tokenizer's vocabulary
SMALL_LM = dict(MID_LM, dim=512, num_heads=8, num_layers=4, depformer_dim=256,
                depformer_num_heads=4, depformer_num_layers=4,
                depformer_dim_feedforward=int(4.125 * 256))
TOKENIZER = Path(__file__).resolve().parent.parent / "tests/data/golden/assets/tokenizer_spm_tiny_512.model"
PROMPT = PersonaPrompt(text_tokens=list(range(10, 40)), key="bench")


class ArrayReader:
    """A stand-in for an opened audio file: 24 kHz mono samples already in memory."""

    def __init__(self, samples: np.ndarray):
        self.samples = samples
        self.sample_rate = 24000
        self.channels = 1
        self.num_frames = self.declared_frames = len(samples)

    def blocks(self, n: int):
        for start in range(0, len(self.samples), n):
            yield self.samples[start:start + n]


def recordings(count: int, low: float, high: float, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    seconds = np.linspace(low, high, count)
    rng.shuffle(seconds)
    return [(0.1 * rng.standard_normal(int(s * 24000))).astype(np.float32) for s in seconds]


def sync(model: Model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def requests(pcm: list[np.ndarray], first: int = 0):
    return [ReplyRequest(first + i, InputFrames(ArrayReader(x)), PROMPT, Sampling(),
                         seed=first + i) for i, x in enumerate(pcm)]


def continuous(model: Model, slots: Scheduler, pcm: list[np.ndarray]
               ) -> tuple[float, int, int]:
    """-> (seconds, stream-frames, steps) for all recordings, a row taking the next one at
    once, the longest first: what `reply` does."""
    start, frames, steps = time.perf_counter(), 0, 0
    for made, _, _ in slots.answer(requests(longest_first(pcm, len))):
        frames += len(made)
        steps += 1
    sync(model)
    return time.perf_counter() - start, frames, steps


def lockstep(model: Model, slots: Scheduler, pcm: list[np.ndarray]
             ) -> tuple[float, int, int]:
    """The same in groups of the batch's size, in input order, each group stepped until its
    longest ends (what `reply` did before)."""
    start, frames, steps = time.perf_counter(), 0, 0
    for first in range(0, len(pcm), slots.capacity):
        group = pcm[first:first + slots.capacity]
        longest = max(len(x) for x in group)
        padded = [np.pad(x, (0, longest - len(x))) for x in group]
        for made, _, _ in slots.answer(requests(padded, first)):
            frames += len(made)
            steps += 1
    sync(model)
    useful = sum(-(-len(x) // 1920) for x in pcm)
    return time.perf_counter() - start, useful, steps


def step_times(model: Model, batch: int, frames: int) -> list[float]:
    slots = Scheduler.for_model(model, batch)
    for b in range(batch):
        slots.join(PROMPT, Sampling(), b)
    pcm = np.random.default_rng(batch).standard_normal((frames, batch, 1920)).astype(np.float32)
    times = []
    for t in range(frames):
        start = time.perf_counter()
        slots.step(0.1 * pcm[t])
        sync(model)
        times.append(time.perf_counter() - start)
    return times[3:]  # the first steps pay one-off allocation costs


def priming(model: Model, batch: int, per_tick: int, frames: int = 60) -> tuple[float, float,
                                                                               int]:
    """batch-1 rows talk; a newcomer with a new persona primes `per_tick` steps after each
    step -> (median step before, longest tick while priming, ticks it took)."""
    slots = Scheduler.for_model(model, batch, cached_personas=0)
    for b in range(batch - 1):
        slots.join(PROMPT, Sampling(), b)
    pcm = 0.1 * np.random.default_rng(0).standard_normal((frames, batch, 1920)).astype(
        np.float32)
    before, during = [], []
    newcomer = PersonaPrompt(text_tokens=list(range(50, 110)))  # 60 tokens + 12 silence
    slot = None
    for t in range(frames):
        start = time.perf_counter()
        slots.step(pcm[t])
        if t == frames // 3:
            slot = slots.begin(newcomer, Sampling(), 99)
        if slot is not None and slot not in slots.live():
            slots.prime(per_tick)
            sync(model)
            during.append(time.perf_counter() - start)
        elif slot is None:
            sync(model)
            before.append(time.perf_counter() - start)
    return statistics.median(before[3:]), max(during), len(during)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--small", action="store_true", help="an LM of dim 512 x 4")
    parser.add_argument("--only", default="step,mixed,priming")
    parser.add_argument("--frames", type=int, default=40, help="frames per step timing")
    parser.add_argument("--mixed", default="32,2,30,8",
                        help="recordings, shortest s, longest s, batch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    only = args.only.split(",")
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        reference.build_mimi(root, seed=1)
        reference.build_lm(root, reference.tiny_lm_kwargs(**(SMALL_LM if args.small
                                                             else MID_LM)), seed=2)
        (root / "tokenizer_spm_32k_3.model").symlink_to(TOKENIZER)
        model = Model(ModelDir(root, "bench"), device, resolve_dtype(args.dtype, device))
        model.mimi, model.lm  # load both before timing
        print(f"device {device}, LM {'512 x 4' if args.small else '1024 x 8'} in "
              f"{str(model.dtype).removeprefix('torch.')}, {args.threads} threads, "
              f"torch {torch.__version__}")
        if "step" in only:
            print(f"\nstep: {args.frames} frames per batch size")
            print(f"{'batch':>5}  {'ms/step':>8}  {'frames/s':>9}  {'vs batch 1':>10}")
            base = None
            for batch in (1, 4, 16):
                step = statistics.median(step_times(model, batch, args.frames))
                throughput = batch / step
                base = base or throughput
                print(f"{batch:>5}  {1000 * step:8.1f}  {throughput:9.1f}  "
                      f"{throughput / base:9.2f}x")
        if "mixed" in only:
            count, low, high, batch = args.mixed.split(",")
            pcm = recordings(int(count), float(low), float(high), seed=3)
            slots = Scheduler.for_model(model, int(batch))
            print(f"\nmixed: {count} recordings of {low} to {high} s "
                  f"({sum(map(len, pcm)) / 24000:.0f} s in all), batch {batch}")
            results, steps = {}, {}
            for mode, run in (("lockstep", lockstep), ("continuous", continuous)):
                seconds, frames, steps[mode] = run(model, slots, pcm)
                results[mode] = frames / seconds
                print(f"{mode:>10}: {seconds:7.1f} s, {frames / seconds:6.1f} stream-frames/s, "
                      f"{steps[mode]} steps")
            print(f"continuous / lockstep: {results['continuous'] / results['lockstep']:.2f}x "
                  f"in throughput, {steps['lockstep'] / steps['continuous']:.2f}x in steps "
                  f"({sum(-(-len(x) // 1920) for x in pcm)} stream-frames of work)")
        if "priming" in only:
            print("\npriming a newcomer (72 steps) while 7 rows talk, batch 8")
            print(f"{'steps/tick':>10}  {'median step ms':>14}  {'longest tick ms':>15}  "
                  f"{'ratio':>6}  {'ticks':>5}")
            for per_tick in (1, 4, 16):
                median, longest, ticks = priming(model, 8, per_tick)
                print(f"{per_tick:>10}  {1000 * median:14.1f}  {1000 * longest:15.1f}  "
                      f"{longest / median:5.2f}x  {ticks:>5}")


if __name__ == "__main__":
    main()
