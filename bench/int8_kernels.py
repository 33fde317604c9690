"""int8 and int4 weight-only matmul kernels against the plain bf16 and fp32 ones, at the 7B's
shapes.

For each linear layer shape of one temporal layer and one depformer step (x: [rows, in],
rows = streams in one batch), the median time of y = x @ W.T with:
  fp32     F.linear, fp32 weights;
  bf16     F.linear, bf16 weights;
  onednn   bf16 weights reordered once into oneDNN's blocked layout for the batch and
           multiplied by its linear primitive (torch.ops.mkldnn; CPU only), not what the
           project runs: how far F.linear's own bf16 path is from the CPU's best;
  int8pack torch._weight_int8pack_mm, int8 weights + one bf16 scale per output row (what
           core/quantize.py runs);
  torchao  torchao's quantize_(Int8WeightOnlyConfig()) on an nn.Linear (when installed);
  dequant  the int8 weights cast to bf16 and F.linear'ed, per call (the plain fallback);
  int4 gG  core/quantize.py's Int4Linear with groups of G weights (32, 64, 128): torch's
           packed int4 kernel (`_weight_int4pack_mm_for_cpu`, or `_weight_int4pack_mm` on
           CUDA).
Prints ms per call and the ratio to bf16 (below 1: faster); then, per int4 group size, the
output's error against bf16 (relative RMS, random Gaussian weights: real weights with
outliers lose more). Weights are random; only the time matters for the rest.

--clock cpu times the calling thread's CPU time instead of the wall clock: with --threads
1 on a machine shared with other jobs, that is the kernel's own cost, the other jobs' turns
left out (cache and memory-bus contention stay in).

Run: python bench/int8_kernels.py [--rows 1,8] [--threads T] [--device cpu|cuda] [--clock cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (name, in, out) of the linear layers one frame runs: one temporal layer, one depformer step
SHAPES = [("temporal in_proj", 4096, 3 * 4096), ("temporal out_proj", 4096, 4096),
          ("temporal gating in", 4096, 2 * 11264), ("temporal gating out", 11264, 4096),
          ("depformer in_proj", 1024, 3 * 1024), ("depformer gating in", 1024, 2 * 2816)]
INT4_GROUPS = (32, 64, 128)


CLOCK = time.perf_counter  # or time.thread_time (--clock cpu)


def timed(fn, device: torch.device, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = CLOCK()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(CLOCK() - start)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def measure(rows: int, k: int, n: int, device: torch.device, repeats: int) -> dict[str, float]:
    from personaplex_cli.core.quantize import Int8Linear

    w = torch.randn(n, k, device=device) / k ** 0.5
    x32 = torch.randn(rows, k, device=device)
    x = x32.to(torch.bfloat16)
    w16 = w.to(torch.bfloat16)
    linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    linear.weight.data.copy_(w16)
    q = Int8Linear.from_linear(linear)
    import personaplex_cli.core.quantize as quantize

    out = {"fp32": timed(lambda: F.linear(x32, w), device, repeats),
           "bf16": timed(lambda: F.linear(x, w16), device, repeats),
           "int8pack": timed(lambda: q(x), device, repeats),
           "dequant": timed(lambda: F.linear(x, q.weight_int8.to(x.dtype)) * q.scale, device,
                            repeats)}
    if device.type == "cpu":
        packed = torch.ops.mkldnn._reorder_linear_weight(w16, rows)
        out["onednn"] = timed(lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [None], ""), device, repeats)
    reference = F.linear(x.float(), w16.float())
    chosen = quantize.INT4_GROUP
    for group in INT4_GROUPS:
        quantize.INT4_GROUP = group  # Int4Linear reads it when built and when called
        try:
            q4 = quantize.Int4Linear.from_linear(linear)
            out[f"int4 g{group}"] = timed(lambda: q4(x), device, repeats)
            error = (q4(x).float() - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
            out[f"error g{group}"] = float(error)
        finally:
            quantize.INT4_GROUP = chosen
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return out
    ao = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=device,
                                             dtype=torch.bfloat16))
    ao[0].weight.data.copy_(w16)
    quantize_(ao, Int8WeightOnlyConfig())
    out["torchao"] = timed(lambda: ao(x), device, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kinds = ("fp32", "bf16", "onednn", "int8pack", "torchao", "dequant",
             *(f"int4 g{group}" for group in INT4_GROUPS))
    print(f"{device}, torch {torch.__version__}, {args.threads} threads; ms per call "
          f"({args.clock} clock; ratio to bf16)")
    print(f"{'layer':22} {'rows':>4} " + " ".join(f"{k:>15}" for k in kinds))
    for rows in (int(r) for r in args.rows.split(",")):
        for name, k, n in SHAPES:
            ms = measure(rows, k, n, device, args.repeats)
            cells = [f"{ms[kind]:7.3f} ({ms[kind] / ms['bf16']:4.2f})" if kind in ms
                     else f"{'-':>15}" for kind in kinds]
            errors = " ".join(f"g{g} {100 * ms[f'error g{g}']:.2f}%" for g in INT4_GROUPS)
            print(f"{name:22} {rows:4} " + " ".join(cells) + f"  int4 error: {errors}")


if __name__ == "__main__":
    main()
