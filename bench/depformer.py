"""A frame's depformer on the CPU: its operations, its kernels, its bytes, and the time it
adds to them, before and after the restructuring, eager and compiled.

The real size's depformer (8 steps of 6 layers, dim 1024) with random weights, at one
precision at a time (the temporal transformer cut to one layer: the depformer never reads
it), run as the frame generator runs it: from a context and the text logits, the 8 steps
with NVIDIA's sampling (keyed noise, temperature and top-k), each step fed the previous
step's token. Timed side by side, in turn, round after round:
  before    the loop as it stood before issue 33 (each step's input projection apart,
            Transformer.forward with its window bookkeeping, sample_rows' parameters read at
            every draw), rebuilt here from the same modules: the same tokens;
  eager     FrameGenerator._sample as it is (one product projects the context for every
            step, the steps' ring slot and mask made once, the draws' parameters read once
            a frame);
  compiled  the same with --compile's step (model/compiled.py), where a C++ compiler is
            found;
  kernels   the frame's matrix products alone: every linear the eager frame called, with
            the inputs it got, in the same order (each int8 linear with its rows'
            quantization), each through its kernel as directly as Python reaches it (the
            kernels built here through their bound ctypes functions, not the modules);
  ... fbgemm  for int8, where its kernel is the one built here (model/native.py): eager and
            kernels again with fbgemm's (and the bf16 linears in F.linear rather than the
            native kernel's tiles), on the same weights held both ways, in turn;
and the floor of its bytes: the weights a frame reads (the input projections, the layers'
linears, the heads) over the bandwidth (the best sum of 2 GiB fp32, bench/floor.py).
Prints, per variant, the median ms a frame (wall, and the process's CPU time over its
threads), what it adds to the kernels ("outside kernels") and to the bytes' floor ("beyond
the bytes"), and the operations one frame dispatches (torch.profiler's events). With
compile, the time the first compile took and, run again with the same --cache, the cached
one's.

Run: python bench/depformer.py [--precisions int8,int4] [--batch 1] [--rounds 7]
                               [--threads T] [--cache DIR] [--no-compile]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import PRECISIONS, bandwidth, both_int8_kernels, random_model  # noqa: E402

from personaplex_cli.core.generator import FrameGenerator  # noqa: E402
from personaplex_cli.core.quantize import kernels_line  # noqa: E402
from personaplex_cli.core.sampling import Sampling, sample_rows  # noqa: E402
from personaplex_cli.doctor.bench import bench_arch  # noqa: E402
from personaplex_cli.model.compiled import (CompilePlan, compile_lm,  # noqa: E402
                                            compile_shape, cxx_compiler)
from personaplex_cli.model.memory import tensor_bytes  # noqa: E402


def before(gen: FrameGenerator, context, text_logits, target, forced, text_noise,
           audio_noise) -> torch.Tensor:
    """The generator's depformer loop as it was before issue 33."""
    s, lm = gen.sampling, gen.lm
    text_noise, audio_noise = s.with_keyed(gen.offset, text_noise, audio_noise)
    text = sample_rows(text_logits, s.temp[0], s.top_k[0], s.greedy[0], text_noise)
    prev = torch.where(forced[:, 0], target[:, 0], text)
    gen.depth.reset()
    sampled = [text]
    for k in range(lm.dep_steps):
        x = lm.depformer_in[k](context)
        emb = lm.depformer_text_emb if k == 0 else lm.depformer_emb[k - 1]
        x = x + emb(prev)[:, None]
        logits = lm.linears[k](lm.depformer(x, gen.depth, k))[:, 0]
        token = sample_rows(logits, s.temp[1], s.top_k[1], s.greedy[1], audio_noise[:, k])
        prev = torch.where(forced[:, 1 + k], target[:, 1 + k], token)
        sampled.append(token)
    return torch.stack(sampled, dim=1)


def frame_inputs(gen: FrameGenerator, batch: int):
    lm = gen.lm
    generator = torch.Generator().manual_seed(0)
    context = torch.randn(batch, 1, lm.dim, generator=generator).to(lm.dtype)
    text_logits = torch.randn(batch, lm.text_card, generator=generator).to(lm.dtype)
    target = gen.initial.expand(batch, -1).clone()
    forced = torch.zeros(batch, lm.num_streams, dtype=torch.bool)
    return (context, text_logits, target, forced, *gen.sampling.draw_generators())


def recorded_linears(gen: FrameGenerator, inputs) -> list:
    """(name, input) of every linear module one eager frame calls, in order, and the fused
    input projection ("depformer_inputs"): by name, so that the modules the names hold at
    the time are timed (both_int8_kernels swaps some)."""
    lm = gen.lm
    calls = [("depformer_inputs", inputs[0])]
    hooks = []
    for part in ("depformer", "linears"):
        for name, module in getattr(lm, part).named_modules(prefix=part):
            if not list(module.children()) and hasattr(module, "in_features"):
                hooks.append(module.register_forward_hook(
                    lambda m, args, out, name=name: calls.append((name, args[0].clone()))))
    gen._sample(*inputs)
    for hook in hooks:
        hook.remove()
    return calls


def kernel_calls(lm, calls) -> list:
    """(function, input) of each recorded linear as its layer stands now: the kernel built
    here bound to the layer's weight where it runs one (the modules' own Python, a few
    microseconds a call, left out), else the module."""
    direct = []
    for name, x in calls:
        if name == "depformer_inputs":
            direct.append((lm.depformer_inputs, x))
            continue
        module = lm.get_submodule(name)
        run = getattr(module, "native_run", None) or getattr(module, "run", None)
        direct.append((module, x) if run is None
                      else (run, x.reshape(-1, module.in_features)))
    return direct


def depformer_bytes(lm) -> int:
    return tensor_bytes(lm.depformer_in) + tensor_bytes(lm.depformer) + tensor_bytes(lm.linears)


def count_ops(fn) -> int:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(event.count for event in prof.key_averages())


def timed_in_turn(variants: dict, rounds: int, setups: dict | None = None
                  ) -> dict[str, tuple[float, float]]:
    """-> {variant: (median wall ms, median CPU ms over the threads)} of one call each;
    `setups[variant]()`, where there is one, runs untimed before each of its calls."""
    threads = torch.get_num_threads()
    setups = setups or {}
    for name, fn in variants.items():
        setups.get(name, lambda: None)()
        fn()
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            setups.get(name, lambda: None)()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(1000 * (time.perf_counter() - start))
            cpu[name].append(1000 * (time.process_time() - start_cpu) / threads)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name]))
            for name in variants}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="int8,int4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--size", default="full", choices=("tiny", "mid", "full"))
    parser.add_argument("--cache", type=Path, default=None,
                        help="the compile cache (default: a fresh one, so it compiles)")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arch = bench_arch(args.size)
    lm_arch = dict(arch.lm, num_layers=1, context=16)  # the depformer never reads the rest
    compiler = None if args.no_compile else cxx_compiler()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="depformer-compile-"))
    print(f"{args.size} depformer, batch {args.batch}, {args.threads} threads, torch "
          f"{torch.__version__}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
          f"CPUs; compiler {compiler or 'none'}; compile cache {cache}", flush=True)
    for name in args.precisions.split(","):
        lm = random_model(lm_arch, 8, PRECISIONS[name], native=name != "int8-fbgemm")
        gen = FrameGenerator(lm, args.batch)
        for row in range(args.batch):
            gen.set_sampling(row, Sampling(), 1000 + row)  # NVIDIA's defaults, keyed noise
        inputs = frame_inputs(gen, args.batch)
        calls = recorded_linears(gen, inputs)
        weights = depformer_bytes(lm)
        variants = {"before": lambda: before(gen, *inputs), "eager": lambda: gen._sample(*inputs)}
        assert torch.equal(variants["before"](), variants["eager"]())  # the same arithmetic
        ops = {variant: count_ops(fn) for variant, fn in variants.items()}
        compile_s = None
        if compiler is not None:
            plan = CompilePlan("on", True, "bench", compiler, cache)
            shape = compile_shape(lm_arch, lm.dep_steps, lm.dtype, PRECISIONS[name],
                                  (args.batch,))
            first = plan.first_time(shape)
            compile_s = compile_lm(lm, plan, shape)
            variants["compiled"] = lambda: gen._sample(*inputs)
            ops["compiled"] = count_ops(variants["compiled"])
            compiled = lm.depformer_compiled
            lm.depformer_compiled = None  # the eager variant runs eager again
            variants["eager"] = lambda: gen._sample(*inputs)

            def run_compiled():
                lm.depformer_compiled = compiled
                try:
                    return gen._sample(*inputs)
                finally:
                    lm.depformer_compiled = None

            variants["compiled"] = run_compiled
        direct = {"calls": kernel_calls(lm, calls)}  # made again where the kernels change

        def kernels():
            for function, x in direct["calls"]:
                function(x)

        variants["kernels"] = kernels
        setups = {}
        use = both_int8_kernels(lm) if name == "int8" else None
        if use is not None:  # fbgemm's kernel beside it, on the same weights, in turn
            def ready(kernel: str) -> None:
                use(kernel)
                direct["calls"] = kernel_calls(lm, calls)

            setups["eager"] = lambda: use("int8")
            setups["eager fbgemm"] = lambda: use("int8-fbgemm")
            setups["kernels"] = lambda: ready("int8")
            setups["kernels fbgemm"] = lambda: ready("int8-fbgemm")
            variants["eager fbgemm"] = variants["eager"]
            variants["kernels fbgemm"] = kernels
            setups["before"] = setups["compiled"] = lambda: use("int8")
            use("int8-fbgemm")
            assert torch.equal(variants["eager"](), variants["before"]())  # the same bits
            ops["eager fbgemm"] = count_ops(variants["eager"])
            use("int8")
        bw = bandwidth(args.threads)
        floor_ms = 1000 * weights / bw
        times = timed_in_turn(variants, args.rounds, setups)
        def kernels_of(variant: str) -> tuple[float, float]:
            return times["kernels fbgemm" if variant.endswith("fbgemm") else "kernels"]

        print(f"{name}: {kernels_line(lm)}; {len(calls)} linear calls a frame; weights read "
              f"{weights / 1e9:.3f} GB, at {bw / 1e9:.1f} GB/s: {floor_ms:.1f} ms")
        if compile_s is not None:
            print(f"  compile ({'first, cold cache' if first else 'cached'}): {compile_s:.1f} s")
        for variant, (wall, cpu) in times.items():
            kernels = kernels_of(variant)
            extra = "" if variant.startswith("kernels") else (
                f"; outside kernels {wall - kernels[0]:6.1f} ms wall, {cpu - kernels[1]:6.1f} "
                f"cpu; beyond the bytes {wall - floor_ms:6.1f} ms wall, {cpu - floor_ms:6.1f} "
                f"cpu; {ops[variant]} operations")
            print(f"  {variant:14} {wall:7.1f} ms wall, {cpu:7.1f} ms cpu{extra}", flush=True)
        del lm, gen, calls, variants
        gc.collect()


if __name__ == "__main__":
    main()
