"""int8 and int4 matmul kernels against the plain bf16 and fp32 ones, at the 7B's shapes.

For each linear layer shape of one temporal layer and one depformer step, and the text head
and one depformer head that quantized models keep in bf16 (x: [rows, in], rows = streams
in one batch), the median time of y = x @ W.T with:
  fp32     F.linear, fp32 weights;
  bf16     F.linear, bf16 weights;
  onednn   bf16 weights reordered once into oneDNN's blocked layout for the batch and
           multiplied by its linear primitive (torch.ops.mkldnn; CPU only), not what the
           project runs: how far F.linear's own bf16 path is from the CPU's best;
  tiled    bf16 weights in the tiles of the kernel built here (model/native.py's NativeBF16,
           rows.c): what a quantized model's bf16 linears run there;
  int8pack torch._weight_int8pack_mm, int8 weights + one bf16 scale per output row
           (--quantize int8-weights);
  native   --quantize int8's kernel on x86 CPUs with AVX-512 VNNI and a C compiler
           (model/native.py, rows.c): each activation row quantized by its own scale
           and multiplied u8 x s8, the weight in its own blocked layout, one call;
  rows     core/quantize.py's Int8RowsLinear with fbgemm's kernel (--quantize int8 on other
           x86 CPUs): the same arithmetic, to the bit, the rows quantized in torch, then
           fbgemm's u8 x s8 kernel on its packed weight, the rows' scales applied after;
  fbgemm pt / fbgemm pc  fbgemm's own dynamic linear (`quantized::linear_dynamic`): ONE
           activation scale for the whole batch (so a row's output depends on its batch),
           the weights per tensor / per output channel;
  dnn rows oneDNN's quantized linear (`onednn::qlinear_pointwise`, what inductor's x86 path
           lowers to) on the same per-row integers as `rows`, prepacked weight;
  torchao  torchao's quantize_(Int8WeightOnlyConfig()) on an nn.Linear (when installed);
  dequant  the int8 weights cast to bf16 and F.linear'ed, per call (the plain fallback);
  int4 gG  core/quantize.py's Int4Linear with groups of G weights (32, 64, 128): torch's
           packed int4 kernel (`_weight_int4pack_mm_for_cpu`, or `_weight_int4pack_mm` on
           CUDA).
The kernels are timed in turn, round after round (so a neighbour's load falls on all of
them alike). Prints ms per call and, in brackets, the weights' bytes read per second (GB/s;
bf16 2 bytes a weight, int8 1, int4 half a byte plus its groups' scales); --ratio prints
the ratio to bf16 instead (below 1: faster). Then, per int4 group size, the output's error
against bf16 (relative RMS, random Gaussian weights: real weights with outliers lose more).
Weights are random; only the time matters for the rest.

--clock cpu times the calling thread's CPU time instead of the wall clock: with --threads
1 on a machine shared with other jobs, that is the kernel's own cost, the other jobs' turns
left out (cache and memory-bus contention stay in).

Run: python bench/int8_kernels.py [--rows 1,8] [--threads T] [--device cpu|cuda] [--clock cpu]
                                  [--ratio]
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
          ("depformer in_proj", 1024, 3 * 1024), ("depformer gating in", 1024, 2 * 2816),
          ("text head", 4096, 32000), ("depformer head", 1024, 2048)]
INT4_GROUPS = (32, 64, 128)


CLOCK = time.perf_counter  # or time.thread_time (--clock cpu)


def timed_in_turn(calls: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Median ms per call of each of `calls`, timed one after the other in each round."""
    for _ in range(3):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = CLOCK()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(CLOCK() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def cpu_int8_calls(x: torch.Tensor, q) -> dict:
    """The CPU's int8 x int8 kernels on int8 weights q (Int8Linear): ours with rows, fbgemm's
    dynamic ones with a scale for the batch, oneDNN's quantized linear on our rows."""
    import warnings

    from personaplex_cli.core.quantize import (ACTIVATION_ZERO_POINT, Int8RowsLinear,
                                               fbgemm_present, quantize_rows, use_native_int8)
    from personaplex_cli.model.native import native_kernel_for

    if not fbgemm_present():
        return {}
    weight, scale = q.int8_weight(), q.scale.float()
    rows = Int8RowsLinear(q.in_features, q.out_features, dtype=x.dtype)
    rows.load_state_dict({"weight_int8": weight, "scale": q.scale})
    use_native_int8(None)
    rows.prepare()  # fbgemm's
    native = native_kernel_for(torch.device("cpu"), "int8")
    n = weight.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        per_channel = torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(
            weight, scale.double(), torch.zeros(n, dtype=torch.long), 0), None)
        dequantized = weight.float() * scale[:, None]
        tensor_scale = float(dequantized.abs().max()) / 127
        per_tensor = torch.ops.quantized.linear_prepack(
            torch.quantize_per_tensor(dequantized, tensor_scale, 0, torch.qint8), None)
    dnn_weight = torch.ops.onednn.qlinear_prepack(weight, None)
    zero = torch.zeros(n, dtype=torch.long)

    def dnn_rows():
        a, a_scale = quantize_rows(x)
        y = torch.ops.onednn.qlinear_pointwise(
            (a + ACTIVATION_ZERO_POINT).to(torch.uint8), 1.0, ACTIVATION_ZERO_POINT, dnn_weight,
            scale, zero, None, 1.0, 0, torch.float32, "none", [], "")
        return y.mul_(a_scale).to(x.dtype)

    calls = {}
    if native is not None:
        run = native.bind(*native.pack(weight, q.scale))
        calls["native"] = lambda: run(x)
    return {**calls, "rows": lambda: rows(x),
            "fbgemm pt": lambda: torch.ops.quantized.linear_dynamic(x.float(), per_tensor),
            "fbgemm pc": lambda: torch.ops.quantized.linear_dynamic(x.float(), per_channel),
            "dnn rows": dnn_rows}


@torch.inference_mode()
def measure(rows: int, k: int, n: int, device: torch.device, repeats: int
            ) -> tuple[dict[str, float], dict[str, float]]:
    """-> (ms per call by kernel, int4's relative error by group size)."""
    from personaplex_cli.core import quantize
    from personaplex_cli.core.quantize import Int8Linear

    w = torch.randn(n, k, device=device) / k ** 0.5
    x32 = torch.randn(rows, k, device=device)
    x = x32.to(torch.bfloat16)
    w16 = w.to(torch.bfloat16)
    linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    linear.weight.data.copy_(w16)
    q = Int8Linear.from_linear(linear)
    calls = {"fp32": lambda: F.linear(x32, w), "bf16": lambda: F.linear(x, w16),
             "int8pack": lambda: q(x),
             "dequant": lambda: F.linear(x, q.weight_int8.to(x.dtype)) * q.scale}
    if device.type == "cpu":
        packed = torch.ops.mkldnn._reorder_linear_weight(w16, rows)
        calls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                     [None], "")
        calls.update(cpu_int8_calls(x, q))
        from personaplex_cli.model.native import native_bf16_for

        tiled = native_bf16_for(device, "int8", torch.bfloat16)
        if tiled is not None:
            run = tiled.bind(tiled.pack(w16), n)
            calls["tiled"] = lambda: run(x)
    reference = F.linear(x.float(), w16.float())
    errors = {}
    chosen = quantize.INT4_GROUP
    for group in INT4_GROUPS:
        quantize.INT4_GROUP = group  # Int4Linear reads it when built and when called
        try:
            q4 = quantize.Int4Linear.from_linear(linear)
            calls[f"int4 g{group}"] = q4  # its own group size is in its scales' shape
            error = (q4(x).float() - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
            errors[f"g{group}"] = float(error)
        finally:
            quantize.INT4_GROUP = chosen
    for group in INT4_GROUPS:  # Int4Linear reads INT4_GROUP when called too
        module = calls[f"int4 g{group}"]
        calls[f"int4 g{group}"] = (lambda m, g: lambda: with_group(m, g, x))(module, group)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return timed_in_turn(calls, device, repeats), errors
    ao = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=device,
                                             dtype=torch.bfloat16))
    ao[0].weight.data.copy_(w16)
    quantize_(ao, Int8WeightOnlyConfig())
    calls["torchao"] = lambda: ao(x)
    return timed_in_turn(calls, device, repeats), errors


def with_group(module, group: int, x: torch.Tensor) -> torch.Tensor:
    from personaplex_cli.core import quantize

    chosen, quantize.INT4_GROUP = quantize.INT4_GROUP, group
    try:
        return module(x)
    finally:
        quantize.INT4_GROUP = chosen


def weight_bytes(kind: str, k: int, n: int) -> float:
    """Bytes of weights (and their scales) a kernel reads per call."""
    if kind == "fp32":
        return 4 * k * n
    if kind in ("bf16", "onednn", "tiled"):
        return 2 * k * n
    if kind.startswith("int4 g"):
        return k * n / 2 + 4 * n * k / int(kind[6:])  # bf16 scale and zero per group
    return k * n + 2 * n  # int8 and its row scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--ratio", action="store_true",
                        help="the ratio to bf16 in brackets instead of GB/s")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kinds = ("fp32", "bf16", "onednn", "tiled", "int8pack", "native", "rows", "fbgemm pt", "fbgemm pc",
             "dnn rows", "torchao", "dequant", *(f"int4 g{group}" for group in INT4_GROUPS))
    import os

    print(f"{device}, torch {torch.__version__}, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}; ms per call ({args.clock} clock; in brackets "
          f"{'the ratio to bf16' if args.ratio else 'GB/s of weights read'})")
    print(f"{'layer':22} {'rows':>4} " + " ".join(f"{k:>15}" for k in kinds))
    for rows in (int(r) for r in args.rows.split(",")):
        for name, k, n in SHAPES:
            ms, errors = measure(rows, k, n, device, args.repeats)
            cells = [f"{'-':>15}" if kind not in ms else
                     f"{ms[kind]:7.3f} ({ms[kind] / ms['bf16']:4.2f})" if args.ratio else
                     f"{ms[kind]:7.3f} ({weight_bytes(kind, k, n) / ms[kind] / 1e6:5.1f})"
                     for kind in kinds]
            error = " ".join(f"{g} {100 * e:.2f}%" for g, e in errors.items())
            print(f"{name:22} {rows:4} " + " ".join(cells) + f"  int4 error: {error}",
                  flush=True)


if __name__ == "__main__":
    main()
