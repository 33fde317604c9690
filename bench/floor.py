"""The CPU's floor for one LM step: its memory bandwidth, the bytes a step reads, and the
measured step against the two.

At batch 1 a step's cost is reading its weights: every linear of the temporal transformer,
the text head, and for each depformer step that runs its input projection, its 6 layers and
its head (the embeddings are looked up, a row each, and not counted). Beside the weights each
step reads the KV window: every layer's keys and values over the whole ring (the attention
runs over the ring's capacity, its empty slots masked), per stream.

  bandwidth  this machine's: the best of several sums of a 2 GiB fp32 tensor, in torch, on
             the same threads as the step (a large read, well past the caches), taken again
             just before each timing run: this VM's moved between 32 and 62 GB/s within an
             hour, so each ratio is against the bandwidth of its own moment;
  floor      (weight bytes + batch x KV bytes) / bandwidth;
  kernels    the same bytes at the rates of the kernels the step calls, each measured here
             alone at the same batch: every weight at the rate of the transformer's largest
             linear (its 32 layers' copies in turn, so each read comes from memory), the KV
             window at the rate of the model's own attention over full rings; so "step / kernels"
             is what the step adds to its kernels (small products, Python, the rest), and
             "kernels / floor" is how far the kernels themselves stand from the bandwidth;
  step       the LM's step at the real size (temporal transformer + text head + the 8
             depformer steps, greedy tokens fed back), median of --steps, per precision
             and batch, in two timing runs on the same model; in wall time, and in the
             process's CPU time over its threads (on a machine shared with other jobs the
             wall time counts their turns too; the CPU time less so).

The model is built with random weights, one precision at a time, the smallest first: the
quantized linears' stored bytes drawn directly (any bytes are valid int8 values or int4
nibbles, and a kernel's speed does not depend on them), so a 7B is ready in seconds instead
of the minutes quantizing takes; doctor --bench measures the loader itself.

`int8-fbgemm` is int8 with fbgemm's kernel where the one built here (model/native.py) would
run, and the bf16 linears (text head, depformer inputs and heads) in F.linear rather than
in the native kernel's tiles: for the two side by side in one run.

`--int8` times instead, side by side in turn on one model (its weights held both ways, so
twice int8's memory), a step with int8's kernel built here and one with fbgemm's (both
activation rows), or where none is built here fbgemm's and int8-weights'
(`_weight_int8pack_mm`), round after round, against the floor taken before each round: on
a machine shared with other jobs, or a VM whose bandwidth moves, they see the same moments.

`--compile` adds, after each precision's eager runs, the same runs with the LM's step
compiled (model/compiled.py: the temporal step for one row, the depformer's steps for any
batch), labelled "+c"; the floor and the kernels are the same.

`--attention` times instead, side by side in turn, one query's attention alone over every
layer's full ring: torch's two matrix products, and core.layers.bag_attention with the keys
by blocks of at most KEY_BLOCK_SLOTS slots and with whole rings as blocks; then a step with
torch's fused attention kernel (what unquantized models run, for the reference's rounding)
and with bag_attention (what quantized models run on the CPU).

Run: python bench/floor.py [--precisions int4,int8,int8-fbgemm,int8-weights,bf16]
                           [--batches 1,8]
                           [--context 3000] [--steps 5] [--size full|mid|tiny] [--threads T]
                           [--attention] [--int8] [--rounds 6] [--compile]
Run it alone, with the memory of the largest precision free (`free -g`).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from personaplex_cli.core.layers import Attention, BlockKVRing, attend, bag_attention
from personaplex_cli.core.lm import LMModel
from personaplex_cli.core.quantize import (kernels_line, prepare_linears, replace_linears,
                                           tile_bf16_linears)
from personaplex_cli.doctor.bench import bench_arch
from personaplex_cli.model.compiled import scratch_draws
from personaplex_cli.model.load import default_dep_steps
from personaplex_cli.model.memory import GIB, tensor_bytes
from personaplex_cli.model.native import native_bf16_for, native_kernel_for, use_native_int8
from personaplex_cli.model.skeleton import shapes_only

READ_PER_STEP = ("transformer", "out_norm", "text_linear", "depformer_in", "depformer",
                 "linears")  # what a step reads whole; the embeddings are looked up
# name -> --quantize; int8 quantizes activation rows on the CPU (with the kernel built here,
# model/native.py, where it runs), int8-fbgemm the same with fbgemm's kernel, int8-weights not
PRECISIONS = {"bf16": "none", "int8": "int8", "int8-fbgemm": "int8",
              "int8-weights": "int8-weights", "int4": "int4"}


def best_seconds(call, repeats: int = 5) -> float:
    call()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth(threads: int, gib: int = 2, repeats: int = 5) -> float:
    """Bytes per second of the best of `repeats` sums over `gib` GiB of fp32."""
    torch.set_num_threads(threads)
    data = torch.ones(gib * GIB // 4)
    return gib * GIB / best_seconds(data.sum, repeats)


def bytes_per_step(lm_arch: dict, dep_steps: int, quantize: str) -> tuple[int, int]:
    """(weight bytes a step reads, KV bytes a step reads per stream) at bf16 compute."""
    with shapes_only():
        lm = LMModel(lm_arch, dep_steps, torch.bfloat16).to(torch.bfloat16)
        replace_linears(lm, quantize, torch.bfloat16)
    weights = sum(tensor_bytes(getattr(lm, part)) for part in READ_PER_STEP)
    state = lm.temporal_state(1)  # on the meta device: shapes only
    kv = sum(t.numel() * t.element_size() for ring in state.values()
             for t in vars(ring).values() if isinstance(t, torch.Tensor) and t.dim() >= 4)
    return weights, kv


@torch.no_grad()
def random_model(lm_arch: dict, dep_steps: int, quantize: str,
                 native: bool = True) -> LMModel:
    """The LM in bf16 on the CPU, `quantize`d, with random contents, allocated once; int8's
    kernel and the bf16 linears' the ones built here where they run (as the loader has
    them), unless not `native` (then fbgemm's and F.linear)."""
    with shapes_only():
        lm = LMModel(lm_arch, dep_steps, torch.bfloat16).to(torch.bfloat16)
    replace_linears(lm, quantize, torch.bfloat16)
    lm = lm.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in [*lm.named_parameters(), *lm.named_buffers()]:
        if tensor.dtype in (torch.uint8, torch.int8):
            tensor.view(torch.uint8).random_(0, 256, generator=generator)
        elif name.endswith("alpha"):
            tensor.fill_(1.0)
        elif name.endswith("scale") or name.endswith("scales_zeros"):
            tensor.uniform_(0.0, 2.0 / tensor.shape[-1] if tensor.dim() > 1 else 1e-3,
                            generator=generator)
        else:
            bound = (3.0 / tensor.shape[-1]) ** 0.5
            tensor.uniform_(-bound, bound, generator=generator)
    use_native_int8(torch.device("cpu"), quantize if native else "none")
    prepare_linears(lm)  # as the loader does: int8's weights packed for its kernel
    lm.fuse_depformer_inputs()
    if native:
        tile_bf16_linears(lm, native_bf16_for(torch.device("cpu"), quantize, torch.bfloat16))
    return lm.eval()


def lm_step(lm: LMModel, temporal, depth, x: torch.Tensor, tokens: torch.Tensor,
            draws: tuple) -> None:
    """One step as the generator runs it: the temporal transformer and the text head, then
    the context projected for every depformer step at once and the steps, each with its
    draw (`draws`: greedy rows, whose race is run, as the generator runs it, and not used)
    and fed the previous one's token; compiled where --compile compiled them."""
    context, text = lm.temporal_runner()(x, temporal)
    depth.reset()
    prev = text.argmax(dim=-1)
    projected = lm.depformer_inputs(context)
    step = lm.depformer_runner()
    for k in range(lm.dep_steps):
        prev = step(k, prev, projected[:, k], depth, *lm.depformer_window(k, depth),
                    *draws)[2]
    tokens.copy_(prev)


def kernel_rates(lm: LMModel, batch: int) -> tuple[float, float]:
    """(weight bytes per second of the transformer's largest linear, KV bytes per second of
    the model's attention over full rings), alone at `batch`."""
    layers = lm.transformer.layers
    linears = [layer.gating.linear_in for layer in layers]
    x = torch.randn(batch, 1, linears[0].in_features).to(lm.dtype)
    linear_rate = (sum(tensor_bytes(m) for m in linears)
                   / best_seconds(lambda: [m(x) for m in linears]))
    attention = layers[0].self_attn
    rings = [layer.self_attn.init_state(batch, torch.device("cpu"), dtype=lm.dtype)
             for layer in layers[:8]]  # 8 layers' rings: well past the caches
    q = torch.randn(batch, attention.num_heads, 1, attention.head_dim).to(lm.dtype)
    capacity = rings[0].values.shape[2]
    mask = torch.ones(1, 1, 1, capacity, dtype=torch.bool)

    def run():
        for ring in rings:
            attend(q, ring, mask)  # as the model's layers do

    kv_bytes = sum(t.numel() * t.element_size() for r in rings for t in vars(r).values())
    return linear_rate, kv_bytes / best_seconds(run)


def time_steps(lm: LMModel, batch: int, steps: int) -> tuple[float, float]:
    """-> (median wall seconds per step, this process's CPU seconds per step over its
    threads: what a shared machine inflates less)."""
    dim = lm.transformer.layers[0].norm1.alpha.shape[-1]
    temporal, depth = lm.temporal_state(batch), lm.depformer_state(batch)
    x = torch.randn(batch, 1, dim).to(lm.dtype)
    tokens = torch.zeros(batch, dtype=torch.long)
    draws = scratch_draws(lm, batch, greedy=True)
    lm_step(lm, temporal, depth, x, tokens, draws)  # warm-up
    times = []
    cpu = time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        lm_step(lm, temporal, depth, x, tokens, draws)
        times.append(time.perf_counter() - start)
    per_thread = (time.process_time() - cpu) / steps / torch.get_num_threads()
    return statistics.median(times), per_thread


def compare_attention(lm: LMModel, name: str, rounds: int = 6) -> None:
    """A batch-1 step with the fused kernel and with bag_attention, in turn (each step
    makes its rings afresh, as the module's kernel choice has them)."""
    modules = [m for m in lm.modules() if isinstance(m, Attention)]
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for fused in (True, False):
            for module in modules:
                module.reference_kernel = fused
            times[fused].append(time_steps(lm, 1, 2)[0])
    fused, bags = (statistics.median(times[k]) for k in (True, False))
    print(f"{name:9} fused kernel {1000 * fused:8.1f} ms, bags {1000 * bags:8.1f} ms: "
          f"{bags / fused:.2f}x", flush=True)


def both_int8_kernels(lm: LMModel):
    """Gives each layer packed for the native int8 kernel fbgemm's packing too, and each
    bf16 linear in the native kernel's tiles a plain nn.Linear -> a function that makes the
    layers run one way ("int8": the kernels built here, or "int8-fbgemm": fbgemm's and
    F.linear), held both ways (twice the memory) so that the two are timed in turn on one
    model; None where no layer runs the native kernel."""
    from personaplex_cli.core import quantize

    layers = [m for m in lm.modules() if isinstance(m, quantize.Int8RowsLinear)
              and m.native_run is not None]
    runs = [m.native_run for m in layers]
    handles = []
    for module in layers:
        handle = next(quantize._HANDLES)
        quantize._PACKED[handle] = quantize.fbgemm_pack(module.int8_weight(),
                                                        module.scale.float())
        handles.append(torch.tensor(handle))

    tiled = {name: module for name, module in lm.named_modules()
             if isinstance(module, quantize.TiledLinear)}
    plain = {name: torch.nn.Linear(m.in_features, m.out_features, bias=False,
                                   dtype=lm.dtype) for name, m in tiled.items()}
    for name, linear in plain.items():
        linear.weight = torch.nn.Parameter(tiled[name].weight, requires_grad=False)
    if "depformer_in_fused" in plain:  # a buffer, the steps' weights views of it
        fused = plain.pop("depformer_in_fused").weight.detach()
        plain["depformer_in_fused"] = fused
        rows = fused.shape[0] // len(lm.depformer_in)
        for step in range(len(lm.depformer_in)):
            plain[f"depformer_in.{step}"].weight = torch.nn.Parameter(
                fused[step * rows:(step + 1) * rows], requires_grad=False)

    def use(kernel: str) -> None:
        for module, run, handle in zip(layers, runs, handles):
            module.native_run = run if kernel == "int8" else None
            module.fbgemm_handle = None if kernel == "int8" else handle
        for name, module in (tiled if kernel == "int8" else plain).items():
            if name == "depformer_in_fused":
                lm._modules.pop(name, None)
                lm._buffers.pop(name, None)
                setattr(lm, name, module)
            else:
                lm.set_submodule(name, module)

    return use if layers else None


def compare_int8_kernels(lm_arch: dict, dep_steps: int, batch: int, threads: int,
                         rounds: int) -> None:
    """int8's kernels (the one built here where it runs, and fbgemm's) against int8-weights'
    on the same weights, a step of each in turn."""
    from personaplex_cli.core.quantize import Int8Linear

    native = native_kernel_for(torch.device("cpu"), "int8") is not None
    lm = random_model(lm_arch, dep_steps, "int8", native=native)
    if native:  # fbgemm's copy beside the native kernel's (a third would not fit 24 GB)
        use = both_int8_kernels(lm)
        steps: dict[str, list[float]] = {"int8": [], "int8-fbgemm": []}
    else:  # int8-weights' copy beside fbgemm's
        linears = [m for m in lm.modules() if isinstance(m, Int8Linear)]
        handles = [m.fbgemm_handle for m in linears]
        for module in linears:
            module.weight_int8 = module.int8_weight()
        steps = {"int8-fbgemm": [], "int8-weights": []}

        def use(kernel: str) -> None:
            for module, handle in zip(linears, handles):
                module.fbgemm_handle = handle if kernel == "int8-fbgemm" else None
    weights, kv = bytes_per_step(lm_arch, dep_steps, "int8")
    floors = []
    for _ in range(rounds):
        bw = bandwidth(threads)
        floors.append((weights + batch * kv) / bw)
        for name in steps:
            use(name)
            steps[name].append(time_steps(lm, batch, 2)[0])
    floor = statistics.median(floors)
    medians = {name: statistics.median(times) for name, times in steps.items()}
    print(f"batch {batch}, {rounds} rounds, {threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}: floor {1000 * floor:.1f} ms (median; "
          f"{1000 * min(floors):.1f} to {1000 * max(floors):.1f})", flush=True)
    last = list(medians)[-1]
    for name, median in medians.items():
        print(f"  {name:12} {1000 * median:7.1f} ms ({median / floor:.2f}x the floor, "
              f"{median / medians[last]:.2f}x {last}); steps "
              f"{', '.join(f'{1000 * t:.0f}' for t in steps[name])}", flush=True)


def compare_attention_kernels(lm_arch: dict, rounds: int = 7) -> None:
    """One query's attention alone over every layer's full bf16 ring at batch 1, in turn:
    torch's two matrix products (the ring slot-major), and bag_attention with the keys by
    blocks (KEY_BLOCK_SLOTS) and with each whole ring as one block."""
    heads, layers = lm_arch["num_heads"], lm_arch["num_layers"]
    head_dim = lm_arch["dim"] // heads
    capacity = lm_arch["context"] + 1
    shape = (1, heads, capacity, head_dim)
    keys = [torch.randn(shape).bfloat16() for _ in range(layers)]
    values = [torch.randn(shape).bfloat16() for _ in range(layers)]
    slots = torch.arange(capacity)[None]
    blocked = []
    for k, v in zip(keys, values):
        ring = BlockKVRing.empty(1, heads, capacity, head_dim, torch.device("cpu"),
                                 torch.bfloat16)
        ring.write(slots, k, v)
        blocked.append(ring)
    whole = [BlockKVRing(r.keys(capacity).transpose(-1, -2).contiguous()[:, :, None],
                         r.values) for r in blocked]  # one block of every slot
    q = torch.randn(1, heads, 1, head_dim).bfloat16()
    mask = torch.ones(1, 1, 1, capacity, dtype=torch.bool)

    def products():
        for k, v in zip(keys, values):
            scores = torch.matmul(q, k.transpose(-1, -2)).float() * head_dim ** -0.5
            torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(-1).bfloat16(), v)

    kinds = {"matrix products": products,
             f"bags, keys by blocks of {blocked[0].key_blocks.shape[-1]}":
                 lambda: [bag_attention(q, r, mask) for r in blocked],
             "bags, whole rings as blocks": lambda: [bag_attention(q, r, mask) for r in whole]}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(rounds):
        for name, call in kinds.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    window = 2 * sum(t.numel() * t.element_size() for t in keys)
    print(f"one query over {layers} full rings ({window / 1e9:.2f} GB), median of {rounds}:")
    for name, spent in times.items():
        median = statistics.median(spent)
        print(f"  {name:32} {1000 * median:7.1f} ms ({window / median / 1e9:5.1f} GB/s)",
              flush=True)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="int4,int8,bf16")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=None,
                        help="the KV window in frames (default the model's, 3000)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--size", default="full", choices=("tiny", "mid", "full"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--compile", action="store_true",
                        help="after each precision's eager runs, the same with the LM's step "
                        "compiled (model/compiled.py), into a fresh cache")
    args = parser.parse_args()
    arch = bench_arch(args.size)
    lm_arch = dict(arch.lm, **({"context": args.context} if args.context else {}))
    dep_steps = default_dep_steps(lm_arch)
    torch.set_num_threads(args.threads)
    if args.int8:
        for batch in (int(b) for b in args.batches.split(",")):
            compare_int8_kernels(lm_arch, dep_steps, batch, args.threads, args.rounds)
        return
    if args.attention:
        print(f"{args.size} LM, batch 1, {args.threads} threads: the step's attention")
        compare_attention_kernels(lm_arch)
        for name in args.precisions.split(","):
            lm = random_model(lm_arch, dep_steps, PRECISIONS[name],
                              native=name != "int8-fbgemm")
            compare_attention(lm, name)
            del lm
            gc.collect()
        return
    print(f"{args.size} LM (dim {lm_arch['dim']}, {lm_arch['num_layers']} layers, "
          f"{dep_steps} depformer steps, window {lm_arch['context']}), {args.threads} threads, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs; bandwidth: the best sum of 2 GiB fp32 just before each run")
    print(f"{'precision':9} {'batch':>5} {'weights GB':>10} {'KV GB':>6} {'linear GB/s':>11} "
          f"{'attn GB/s':>9} {'run':>3} {'GB/s':>5} {'floor ms':>8} {'kernels ms':>10} "
          f"{'/floor':>6} {'step ms':>8} {'/floor':>6} {'cpu ms':>7} {'/floor':>6} {'/kernels':>8}")
    for name in args.precisions.split(","):
        quantize = PRECISIONS[name]
        weights, kv = bytes_per_step(lm_arch, dep_steps, quantize)
        lm = random_model(lm_arch, dep_steps, quantize, native=name != "int8-fbgemm")
        print(f"{name}: {kernels_line(lm)}", flush=True)
        batches = [int(b) for b in args.batches.split(",")]
        rates = {batch: kernel_rates(lm, batch) for batch in batches}
        for label in (name, f"{name}+c") if args.compile else (name,):
            if label != name:
                print(f"{label}: {compile_step(lm, lm_arch, dep_steps, quantize, batches)}",
                      flush=True)
            for batch in batches:
                linear_rate, attention_rate = rates[batch]
                kernels = weights / linear_rate + batch * kv / attention_rate
                for run in range(1, args.runs + 1):
                    bw = bandwidth(args.threads)
                    floor = (weights + batch * kv) / bw
                    step, cpu = time_steps(lm, batch, args.steps)
                    print(f"{label:9} {batch:5d} {weights / 1e9:10.2f} {batch * kv / 1e9:6.2f} "
                          f"{linear_rate / 1e9:11.1f} {attention_rate / 1e9:9.1f} {run:3d} "
                          f"{bw / 1e9:5.1f} {1000 * floor:8.1f} {1000 * kernels:10.1f} "
                          f"{kernels / floor:6.2f} {1000 * step:8.1f} {step / floor:6.2f} "
                          f"{1000 * cpu:7.1f} {cpu / floor:6.2f} {step / kernels:8.2f}",
                          flush=True)
        del lm
        gc.collect()


def compile_step(lm: LMModel, lm_arch: dict, dep_steps: int, quantize: str,
                 batches: list[int]) -> str:
    """--compile's step for `lm`, compiled into a fresh cache -> a line saying how long."""
    import tempfile
    from pathlib import Path

    from personaplex_cli.model.compiled import (CompilePlan, compile_batches, compile_lm,
                                                compile_shape, cxx_compiler)

    cache = Path(tempfile.mkdtemp(prefix="floor-compile-"))
    plan = CompilePlan("on", True, "bench", cxx_compiler(), cache)
    shape = compile_shape(lm_arch, dep_steps, lm.dtype, quantize, compile_batches(max(batches)))
    seconds = compile_lm(lm, plan, shape)
    return f"compiled in {seconds:.1f} s ({cache})"


if __name__ == "__main__":
    main()
