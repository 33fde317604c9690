"""`personaplex doctor --bench`: what this machine does with the model, before downloading it.

Random weights at the real dimensions (or the golden tiny's, or a model of about 1.7 B),
nothing downloaded: the LM is built through `model.load.build_lm`, the path `reply` loads
the checkpoint through (one tensor at a time, quantized on the device as it comes), with
each tensor drawn on the device instead of read from the file. Then, as `reply` runs:
the engine's slots, a short persona primed, and frames of noise at batch 1 and at the
batch the device's memory holds (model/memory.py's count, capped at MAX_BATCH).

Reported: the kernel each of the transformers' linears ran (int8's fbgemm with activation
rows, the weight-only kernel, int4's, F.linear), whether the depformer ran compiled
(--compile) and how long compiling took, load and priming time, frame time p50/p99 at each
batch, how they stepped (CUDA graphs or eager), the callers held in real time and peak
memory against the count; beside it the command runs doctor/agree.py's check (the CPU, the
device eager and with graphs, on one seeded tiny model, teacher-forced). The callers are
decided by
runtime/warmup.py's one rule (`Capacity`), the one serve's and talk's warm-ups apply, on the
medians measured here, at the thread count serve and talk remembered for this machine and
model shape where they did; two batches only, so a rough count where serve sweeps 1, 2, 4...
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.config import FRAME_SIZE, Arch
from ..core.graphs import live_buckets
from ..core.lm import LMModel
from ..core.mimi import Mimi
from ..core.priming import PersonaTokens
from ..core.quantize import kernels_line
from ..core.sampling import Sampling
from ..core.slots import Slots
from ..model.device import check_graphs, check_quantize, resolve_device
from ..model.load import build_lm, default_dep_steps
from ..model.memory import (GIB, available_bytes, check_fits, memory_need, release_free_memory,
                            sessions_that_fit)
from ..model.model import resolve_dtype
from ..model.random_model import random_init, tiny_arch
from ..runtime.warmup import (STEP_BUDGET_MS, Capacity, Threads, ThreadsMemory,
                              apply_remembered, percentile_ms, real_time_rows)

SIZES = ("tiny", "mid", "full")
# About 1.7 B parameters: half the width, half the depth of the 7B; its depformer and Mimi.
MID_LM = dict(dim=2048, num_heads=16, num_layers=16)
MAX_BATCH = 64  # the largest batch measured, however much memory is free
PERSONA = PersonaTokens((10, 11))  # the shortest persona: priming is its fixed frames
FRAMES = {"tiny": 50, "mid": 20, "full": 6}  # frames timed per batch, by default


def bench_arch(size: str) -> Arch:
    if size == "tiny":  # the tiny model's (`download --tiny`), the golden checkpoints'
        return tiny_arch()
    arch = Arch()
    if size == "mid":
        arch.lm.update(MID_LM)
    return arch


def random_source(lm_arch: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """`tensor_for(key)` for build_lm: each of the LM's tensors drawn on `device` in `dtype`
    when asked for (uniform, variance 1 / fan-in; norm gains 1), never all at once."""
    with torch.device("meta"):
        shapes = {key: tuple(t.shape) for key, t in LMModel(lm_arch).state_dict().items()}
    generator = torch.Generator(device).manual_seed(seed)

    def tensor_for(key: str) -> torch.Tensor:
        shape = shapes.get(key)
        if shape is None:  # a depformer step's own weight: the same shape for every step
            shape = shapes[re.sub(r"\.\d+\.", ".0.", key, count=1)]
        if key.endswith("alpha"):
            return torch.ones(shape, dtype=dtype, device=device)
        bound = (3.0 / shape[-1]) ** 0.5
        tensor = torch.empty(shape, dtype=dtype, device=device)
        return tensor.uniform_(-bound, bound, generator=generator)

    return tensor_for


def random_mimi(arch: Arch, device: torch.device, seed: int) -> Mimi:
    mimi = Mimi(arch.mimi)
    random_init(mimi, torch.Generator().manual_seed(seed))
    return mimi.to(device).eval().prepare()


def peak_rss() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", text, re.M).group(1)) * 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux resets the process's peak RSS (VmHWM) to its RSS now
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def peak_bytes(device: torch.device) -> int:
    """The run's peak: the CUDA allocator's plus the context's (memory the device lost
    beyond the allocator: the driver's, cuBLAS's), or the process's peak RSS."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside = (total - free) - torch.cuda.memory_reserved(device)
        return torch.cuda.max_memory_reserved(device) + max(0, outside)
    return peak_rss()


@dataclass
class Batch:
    batch: int
    prime_s: float
    frame_ms_p50: float
    frame_ms_p99: float
    real_time: bool  # every row of the batch keeps real time, by the warm-up's rule
    graphs: bool = False  # stepped by CUDA graphs


@dataclass
class BenchReport:
    size: str
    device: str
    dtype: str
    quantize: str
    threads: int
    load_s: float
    count_gib: float  # model/memory.py's need for the largest batch measured
    peak_gib: float
    batches: list[Batch] = field(default_factory=list)
    callers_in_real_time: int = 0
    capacity: str = ""  # runtime.warmup.Capacity's line for these measurements, as serve's
    steps: str = ""  # how the timed batches stepped: CUDA graphs or eager
    graphs_fallback: str | None = None  # why they stepped eager though graphs were on auto
    kernels: str = ""  # which kernel the transformers' linears ran (core.quantize)
    compile: str = ""  # --compile's line (model/compiled.py)
    compile_s: float = 0.0  # compiling (or loading the compiled code), in the load

    def as_json(self) -> dict:
        return asdict(self)


def time_batch(mimi: Mimi, lm: LMModel, batch: int, frames: int, graphs: bool | None,
               fallbacks: list[str] | None = None) -> Batch:
    """`fallbacks` gets why the batch steps eager though graphs were on auto, if it does."""
    device = next(mimi.parameters()).device
    slots = Slots(mimi, lm, batch, graphs=graphs)
    if slots.graphs_fallback and fallbacks is not None:
        fallbacks.append(slots.graphs_fallback)
    start = time.perf_counter()
    for row in range(batch):
        slots.join(PERSONA, Sampling(greedy=True), torch.Generator(device).manual_seed(row),
                   key="bench")
    prime_s = time.perf_counter() - start
    audio = 0.1 * torch.randn(frames + 1, batch, FRAME_SIZE, generator=torch.Generator()
                              .manual_seed(1)).to(device)
    times = []
    for pcm in audio:
        start = time.perf_counter()
        slots.step(pcm)  # host copies: the step has finished when it returns
        times.append(1000 * (time.perf_counter() - start))
    times = times[1:]  # the first frame pays for warming up (and capture, with graphs)
    # serve's /metrics and the warm-up read the same measure, and decide by the same rule
    p50 = percentile_ms(times, 0.50)
    return Batch(batch, prime_s, p50, percentile_ms(times, 0.99),
                 real_time_rows({batch: p50}) >= batch, slots.session.graphs)


def bench_threads(device: torch.device, dtype: torch.dtype, quantize: str,
                  lm_arch: dict) -> Threads:
    """The thread count serve and talk measured and remembered for this machine, model
    shape, dtype and quantization, applied; else OMP_NUM_THREADS's, or torch's own."""
    from ..model.files import tool_cache_dir

    memory = ThreadsMemory.for_model(tool_cache_dir(), device.type, str(dtype), quantize,
                                     lm_arch)
    return apply_remembered(memory, device.type)



@torch.inference_mode()
def run_bench(size: str = "full", device_name: str = "auto", dtype_name: str | None = None,
              quantize: str = "none", frames: int | None = None, max_batch: int = MAX_BATCH,
              progress=None, graphs: bool | None = None, compile_mode: str = "off",
              announce=None) -> BenchReport:
    """The bench, or DeviceError (exit 5) before anything is allocated when the device lacks
    the memory for one stream or the quantization's kernels (or --compile on cannot be).
    `graphs`: --graphs for the timed batches (None: auto). `progress` hears what it is
    doing, `announce` (default: progress) that it compiles."""
    say = progress or (lambda message: None)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device)
    check_quantize(device, quantize, dtype)
    check_graphs(device, graphs)
    from ..model.compiled import compile_batches, compile_depformer, compile_shape, plan_compile

    plan = plan_compile(compile_mode, device, quantize)  # --compile on that cannot be: exit 5
    arch = bench_arch(size)
    dep_steps = default_dep_steps(arch.lm)
    check_fits(arch, arch.lm, dep_steps, device, dtype, quantize, graphs=graphs)
    one = memory_need(arch, arch.lm, dep_steps, device, dtype, quantize, graphs=graphs)
    have = available_bytes(device)
    capacity = max(1, min(max_batch, sessions_that_fit(one, have) if have is not None else 1))
    frames = frames or FRAMES[size]
    threads = bench_threads(device, dtype, quantize, arch.lm)
    reset_peak(device)
    say(f"building the {size} LM with random weights on {device} "
        f"({str(dtype).removeprefix('torch.')}, quantize {quantize})")
    start = time.perf_counter()
    lm = build_lm(arch.lm, dep_steps, device, dtype, quantize,
                  random_source(arch.lm, device, dtype, seed=0))
    shape = compile_shape(arch.lm, dep_steps, dtype, quantize, compile_batches(capacity))
    compile_line = plan.line(shape)
    (announce or say if plan.first_time(shape) else say)(compile_line)
    compile_s = compile_depformer(lm, plan, shape)
    mimi = random_mimi(arch, device, seed=0)
    load_s = time.perf_counter() - start
    batches, fallbacks = [], []
    for batch in sorted({1, capacity}):
        say(f"priming and {frames} frames at batch {batch}")
        batches.append(time_batch(mimi, lm, batch, frames, graphs, fallbacks=fallbacks))
        release_free_memory()
    need = memory_need(arch, arch.lm, dep_steps, device, dtype, quantize, streams=capacity,
                       graphs=graphs)
    held = Capacity(device.type, threads, {b.batch: b.frame_ms_p50 for b in batches},
                    fits_memory=capacity,
                    buckets=live_buckets(capacity) if all(b.graphs for b in batches) else None)
    report = BenchReport(size, str(device), str(dtype).removeprefix("torch."), quantize,
                         threads.count, load_s, need.total / GIB, peak_bytes(device) / GIB,
                         batches, held.real_time, held.line().removeprefix("warm-up: "),
                         steps="CUDA graphs" if all(b.graphs for b in batches) else "eager",
                         graphs_fallback=fallbacks[0] if fallbacks else None,
                         kernels=kernels_line(lm), compile=compile_line, compile_s=compile_s)
    return report


def report_lines(report: BenchReport) -> list[str]:
    compiled = (f" (of which {report.compile_s:.1f} s compiling the depformer)"
                if report.compile_s else "")
    lines = [f"bench    {report.size} model, random weights, on {report.device} "
             f"({report.dtype}, quantize {report.quantize}, {report.threads} thread"
             f"{'' if report.threads == 1 else 's'}; {report.steps})",
             f"kernels  {report.kernels}",
             f"{report.compile.replace('compile: ', 'compile  ', 1)}",
             f"load     {report.load_s:.1f} s{compiled}"]
    for b in report.batches:
        lines.append(f"batch {b.batch:<3}priming {b.prime_s:.1f} s; frame p50 "
                     f"{b.frame_ms_p50:.1f} ms, p99 {b.frame_ms_p99:.1f} ms "
                     f"({'within' if b.real_time else 'over'} the step's budget of "
                     f"{STEP_BUDGET_MS:.0f} ms)")
    lines.append(f"callers  {report.capacity} (serve's and talk's rule: a step's median "
                 f"within {STEP_BUDGET_MS:.0f} ms, between batches linearly)")
    lines.append(f"memory   peak {report.peak_gib:.2f} GiB against model/memory.py's count of "
                 f"{report.count_gib:.2f} GiB ({report.peak_gib / report.count_gib:.2f} of it)")
    return lines
