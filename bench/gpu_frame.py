"""A full PersonaPlex frame on CUDA at the real dimensions, eager against CUDA graphs.

Random bf16 weights in the real shapes (7B temporal transformer, 16-step depformer of which 8
run, full-size fp32 Mimi), built directly on the GPU. Per frame: Mimi encode of 80 ms of
audio, one generator step, Mimi decode, and the one device-to-host copy of the frame's audio
and tokens. Prints p50 / p99 / max ms over the run, the p50 of its first and last 500 frames
(flat means the 3000-frame KV window costs the same full or empty), and peak GPU memory
against model/memory.py's count (the batch's KV windows and the primer's, and with graphs
what model/memory.py counts for them): the margin it measures is what memory.CUDA_MARGIN
estimates. With --quantize, each mode also runs with the transformers' linears in int8,
int4 or fp8 (core/quantize.py), after checking each kernel against its dequantized weight on the
device. Goal on an H200: p50 <= 8 ms, p99 <= 12 ms, flat.

With --batch B the frame is one step of B rows (times per step). The mode "slots" is "graphs"
with rows that come and go: every 100 frames one row leaves and a newcomer with a new persona
joins its row, primed 8 steps after each frame, as `serve` does; the graphs are never
captured again, so its step times should match "graphs" except for the priming ticks.

Run: python bench/gpu_frame.py [--frames 3200] [--modes eager,graphs,slots] [--batch B]
                                [--quantize none,int8,int4,fp8]
     python bench/gpu_frame.py --tiny --device cpu --modes eager   (checks the script itself)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from personaplex_cli.core.lm import LMModel
from personaplex_cli.core.mimi import Mimi
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.model.skeleton import shapes_only
from personaplex_cli.core.quantize import QUANTIZED_LINEAR, quantized_linears
from personaplex_cli.doctor.bench import BenchModel
from personaplex_cli.prompts.persona import PersonaPrompt
from personaplex_cli.runtime.scheduler import Scheduler
from personaplex_cli.doctor.bench import bench_arch, random_init
from personaplex_cli.core.config import primer_rows
from personaplex_cli.model.memory import (default_dep_steps, graph_bytes_per_row,
                                          kv_bytes_per_stream, tensor_bytes)

def build(device: torch.device, tiny: bool) -> tuple[Mimi, LMModel]:
    arch = bench_arch("tiny" if tiny else "full")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with shapes_only():
        lm = LMModel(arch.lm, dep_steps=8, dtype=dtype).to(dtype)
    lm = lm.to_empty(device=device)  # allocated once, in bf16, on the GPU
    random_init(lm)
    mimi = Mimi(arch.mimi)
    random_init(mimi)
    return mimi.to(device).eval().prepare(), lm.eval()


@torch.no_grad()
def quantize_in_place(lm: LMModel, mode: str) -> None:
    """Swaps the transformers' linears for quantized ones, each kernel checked first against
    a plain matmul of its dequantized weight on this device."""
    import torch.nn.functional as F

    worst = 1.0
    for name in quantized_linears(lm):
        linear = lm.get_submodule(name)
        module = QUANTIZED_LINEAR[mode].from_linear(linear)
        x = torch.randn(4, linear.in_features, device=linear.weight.device,
                        dtype=linear.weight.dtype)
        cos = F.cosine_similarity(module(x).float().flatten(),
                                  F.linear(x, module.dequantized()).float().flatten(), dim=0)
        worst = min(worst, cos.item())
        lm.set_submodule(name, module)
    print(f"{mode}: each kernel against its dequantized weight, lowest cosine {worst:.6f}")


def run(mimi: Mimi, lm: LMModel, arch, quantize: str, mode: str, frames: int,
        batch: int) -> np.ndarray:
    device = next(lm.parameters()).device
    model = BenchModel(arch, device, lm.dtype, quantize, mimi=mimi, lm=lm)
    slots = Scheduler.for_model(model, batch, graphs=mode != "eager")
    persona = PersonaPrompt(list(range(10, 40)), key="p")
    for row in range(batch):
        slots.join(persona, Sampling(), row)
    audio = (0.1 * torch.randn(frames, batch, 1920)).numpy()
    times = []
    newcomer = None
    for t in range(frames):
        start = time.perf_counter()
        slots.step(audio[t])  # host copies: the one transfer per frame
        if mode == "slots":
            if t % 100 == 50:
                slots.leave(t // 100 % batch)
                newcomer = slots.begin(PersonaPrompt(list(range(10, 40 + t % 7))), Sampling(),
                                       t)
            if newcomer is not None:
                slots.prime(8)
        times.append(time.perf_counter() - start)
    return 1000 * np.array(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=3200)
    parser.add_argument("--modes", default="eager,graphs,slots")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script")
    parser.add_argument("--quantize", default="none",
                        help="none, int8, int4, fp8, comma-separated")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    arch = bench_arch("tiny" if args.tiny else "full")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # The batch's windows and the primer's, and with graphs what they hold, as counted.
    rows = args.batch + primer_rows(args.batch)
    kv = rows * kv_bytes_per_stream(arch.lm, arch.mimi.transformer, dtype)
    graphed = rows * graph_bytes_per_row(arch, arch.lm, default_dep_steps(arch.lm), dtype)
    print(f"{name}, torch {torch.__version__}, {args.frames} frames, batch {args.batch}")
    print(f"{'quantize':8} {'mode':8} {'p50':>7} {'p99':>7} {'max':>7} {'p50 first 500':>14} "
          f"{'p50 last 500':>13} {'peak GiB':>9} {'margin GiB':>11}")
    for quantize in args.quantize.split(","):
        torch.manual_seed(0)  # the same random weights for every quantization
        mimi, lm = build(device, args.tiny)
        if quantize != "none":
            quantize_in_place(lm, quantize)
        # The margin is the rest of the allocator's peak (the CUDA context comes on top).
        held = tensor_bytes(lm) + tensor_bytes(mimi) + kv
        for mode in args.modes.split(","):
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            ms = run(mimi, lm, arch, quantize, mode, args.frames, args.batch)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            counted = held + (graphed if mode != "eager" else 0)
            head, tail = ms[:min(500, len(ms))], ms[-min(500, len(ms)):]
            print(f"{quantize:8} {mode:8} {np.percentile(ms, 50):7.2f} "
                  f"{np.percentile(ms, 99):7.2f} {ms.max():7.2f} {np.median(head):14.2f} "
                  f"{np.median(tail):13.2f} {peak / 2**30:9.2f} {(peak - counted) / 2**30:11.2f}")
        del mimi, lm


if __name__ == "__main__":
    main()
