"""Offline reply throughput: frames per second at batch 1, 4 and 16, through the code path
`personaplex reply` runs (Conversation + reply_stream: Mimi encode, LM step, Mimi decode).

A mid-size random model: the full-size Mimi and an LM of dim 1024 x 8 layers with a
512 x 6 depformer (PersonaPlex's structure, 16 depformer steps in the checkpoint, the 8
assistant steps run; a 512-token text vocabulary, the tests' tokenizer), built with Kyutai's
reference and saved in the published layout.
Priming is not timed. Prints, per batch size, the median time of one lockstep step, the
stream-frames per second, and the ratio against batch 1 (the goal: batch 16 well above 1).

Run: python bench/reply.py [--frames N] [--threads T] [--device cpu|cuda] [--dtype ...]
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
from personaplex_cli.conversation import Conversation, PersonaPrompt, reply_stream  # noqa: E402
from personaplex_cli.core.sampling import Sampling  # noqa: E402
from personaplex_cli.model.device import resolve_device  # noqa: E402
from personaplex_cli.model.files import ModelDir  # noqa: E402
from personaplex_cli.model.model import Model, resolve_dtype  # noqa: E402

MID_LM = dict(dim=1024, num_heads=16, num_layers=8, depformer_dim=512, depformer_num_heads=8,
              depformer_num_layers=6, depformer_dim_feedforward=int(4.125 * 512),
              text_card=512)  # the golden tiny tokenizer's vocabulary
TOKENIZER = Path(__file__).resolve().parent.parent / "tests/data/golden/assets/tokenizer_spm_tiny_512.model"


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


def run(model: Model, batch: int, frames: int) -> list[float]:
    prompt = PersonaPrompt(text_tokens=list(range(10, 40)))
    conversation = Conversation(model, prompt, Sampling(), batch=batch)
    conversation.start([b for b in range(batch)])
    rng = np.random.default_rng(batch)
    inputs = [InputFrames(ArrayReader((0.1 * rng.standard_normal(frames * 1920))
                                      .astype(np.float32))) for _ in range(batch)]
    times = []
    last = time.perf_counter()
    for _ in reply_stream(conversation, inputs):
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[3:]  # the first steps pay one-off allocation costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=40, help="frames per stream")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--batches", default="1,4,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        reference.build_mimi(root, seed=1)
        reference.build_lm(root, reference.tiny_lm_kwargs(**MID_LM), seed=2)
        (root / "tokenizer_spm_32k_3.model").symlink_to(TOKENIZER)
        model = Model(ModelDir(root, "bench"), device, resolve_dtype(args.dtype, device))
        model.mimi, model.lm  # load both before timing
        print(f"device {device}, LM {str(model.dtype).removeprefix('torch.')}, "
              f"{args.threads} threads, {args.frames} frames per stream")
        print(f"{'batch':>5}  {'ms/step':>8}  {'frames/s':>9}  {'vs batch 1':>10}")
        base = None
        for batch in (int(b) for b in args.batches.split(",")):
            step = statistics.median(run(model, batch, args.frames))
            throughput = batch / step
            base = base or throughput
            print(f"{batch:>5}  {1000 * step:8.1f}  {throughput:9.1f}  {throughput / base:9.2f}x")


if __name__ == "__main__":
    main()
