"""`personaplex doctor --bench`: what this machine does with the model, before downloading it.

Random weights at the real dimensions (or the golden tiny's, or a model of about 1.7 B),
nothing downloaded: the LM is built through `model.load.build_lm`, the path `reply` loads
the checkpoint through (one tensor at a time, quantized on the device as it comes), with
each tensor drawn on the device instead of read from the file. Then the runtime is opened as
`serve` opens it (runtime.open: the memory check, the session of as many rows as the
device's memory holds, capped at MAX_BATCH, a short persona primed, the threads decided,
the warm-up) but timing one live row and all of them, --frames each, rather than serve's
sweep, so that the peak memory is measured at the count.

Reported: the kernel each of the transformers' linears ran (int8's fbgemm with activation
rows, the weight-only kernel, int4's, F.linear), whether the depformer ran compiled
(--compile) and how long compiling took, load and priming time, frame time p50/p99 at each batch, how they stepped (CUDA
graphs or eager), the callers held in real time by the warm-up's one rule
(runtime.warmup.Capacity: serve's and talk's) and peak memory against the count; beside it
the command runs doctor/agree.py's check (the CPU, the device eager and with graphs, on one
seeded tiny model, teacher-forced).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from ..core.config import Arch
from ..core.layers import attention_line
from ..core.lm import LMModel
from ..core.mimi import Mimi
from ..core.quantize import kernels_line
from ..model.device import check_graphs, check_quantize, resolve_device
from ..model.load import build_lm, default_dep_steps
from ..model.memory import GIB, available_bytes, check_fits, memory_need, sessions_that_fit
from ..model.model import Model, resolve_dtype
from ..model.random_model import random_init, tiny_arch
from ..model.skeleton import shapes_only
from ..prompts.persona import PersonaPrompt
from ..runtime.warmup import STEP_BUDGET_MS

SIZES = ("tiny", "mid", "full")
# About 1.7 B parameters: half the width, half the depth of the 7B; its depformer and Mimi.
MID_LM = dict(dim=2048, num_heads=16, num_layers=16)
MAX_BATCH = 64  # the largest batch measured, however much memory is free
PERSONA = PersonaPrompt([10, 11], key="bench")  # the shortest: priming is its fixed frames
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
    with shapes_only():
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
    attention: str = ""  # which kernel answered one query in the LM's attention (core.layers)
    compile: str = ""  # --compile's line (model/compiled.py)
    compile_s: float = 0.0  # compiling (or loading the compiled code), in the load

    def as_json(self) -> dict:
        return asdict(self)


class BenchModel:
    """What the runtime asks of a model (model.model.Model's face), with random weights at
    `arch`, built on first use as Model loads its files: the memory check before, then the
    LM through reply's loader and Mimi."""

    tokenizer = None  # no text pieces to read

    def __init__(self, arch: Arch, device: torch.device, dtype: torch.dtype, quantize: str,
                 seed: int = 0, mimi: Mimi | None = None, lm: LMModel | None = None,
                 graphs: bool | None = None, compile_mode: str = "off"):
        from ..model.compiled import plan_compile

        self.arch, self.device, self.dtype, self.quantize = arch, device, dtype, quantize
        self.graphs = graphs  # --graphs, as model.Model carries it
        self.dep_steps = default_dep_steps(arch.lm)
        self.seed = seed
        self.load_s = 0.0
        self.compile_plan = plan_compile(compile_mode, device, quantize)  # as Model decides
        self.compile_rows = 1
        self.compile_line, self.compile_s = "", 0.0  # what --compile did, for the report
        if mimi is not None:
            self.mimi = mimi
        if lm is not None:
            self.lm = lm

    @property
    def lm_arch(self) -> dict:
        return self.arch.lm

    def need(self, streams: int = 1):
        return memory_need(self.arch, self.arch.lm, self.dep_steps, self.device, self.dtype,
                           self.quantize, streams, graphs=self.graphs)

    def preflight(self, streams: int = 1, streams_option: str | None = None):
        return check_fits(self.arch, self.arch.lm, self.dep_steps, self.device, self.dtype,
                          self.quantize, streams, streams_option, graphs=self.graphs)

    def sessions_that_fit(self) -> int | None:
        have = available_bytes(self.device)
        return None if have is None else sessions_that_fit(self.need(), have)

    _compile_shape = Model._compile_shape
    int8_kernel_line = Model.int8_kernel_line
    compiled_operators_line = Model.compiled_operators_line

    def compile_for(self, rows: int) -> tuple[str, bool]:
        self.compile_line, compiling = Model.compile_for(self, rows)
        return self.compile_line, compiling

    @cached_property
    def lm(self) -> LMModel:
        from ..model.compiled import compile_lm

        start = time.perf_counter()
        lm = build_lm(self.arch.lm, self.dep_steps, self.device, self.dtype, self.quantize,
                      random_source(self.arch.lm, self.device, self.dtype, seed=self.seed))
        self.compile_s = compile_lm(lm, self.compile_plan, self._compile_shape())
        self.load_s += time.perf_counter() - start
        return lm

    @cached_property
    def mimi(self) -> Mimi:
        start = time.perf_counter()
        mimi = random_mimi(self.arch, self.device, seed=self.seed)
        self.load_s += time.perf_counter() - start
        return mimi


@torch.inference_mode()
def run_bench(size: str = "full", device_name: str = "auto", dtype_name: str | None = None,
              quantize: str = "none", frames: int | None = None, max_batch: int = MAX_BATCH,
              progress=None, graphs: bool | None = None, warn=None, compile_mode: str = "off",
              announce=None) -> BenchReport:
    """The bench, or DeviceError (exit 5) before anything is allocated when the device lacks
    the memory for one stream or the quantization's kernels (or --compile on cannot be).
    `graphs`: --graphs for the timed batches (None: auto); `warn` gets the line that says
    why they stepped eager though graphs were on auto, if they did; `announce` (default:
    `progress`) that the depformer compiles (minutes, once)."""
    from ..runtime import open as open_runtime
    from ..runtime.scheduler import Pacing

    say = progress or (lambda message: None)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device)
    check_quantize(device, quantize, dtype)
    check_graphs(device, graphs)
    model = BenchModel(bench_arch(size), device, dtype, quantize, graphs=graphs,
                       compile_mode=compile_mode)  # --compile on that cannot be: exit 5
    reset_peak(device)
    say(f"random weights of the {size} model on {device} "
        f"({str(dtype).removeprefix('torch.')}, quantize {quantize}); one live row, then "
        f"as many as fit, {frames or FRAMES[size]} frames each")
    scheduler = open_runtime(model, PERSONA, None, Pacing.TICK, most=max_batch,
                             counts=lambda rows: sorted({1, rows}),
                             frames=frames or FRAMES[size], say=say,
                             warn=warn or (lambda line: None), note=announce)
    held = scheduler.warmup
    capacity = scheduler.capacity
    graphed = scheduler.session.graphs
    peak = peak_bytes(device)
    prime_s = held.prime_ms * PERSONA.frames / 1000.0
    batches = [Batch(rows, prime_s, times.p50_ms, times.p99_ms, held.real_time >= rows,
                     graphed) for rows, times in sorted(held.times.items())]
    report = BenchReport(size, str(device), str(dtype).removeprefix("torch."), quantize,
                         held.threads.count, model.load_s, model.need(capacity).total / GIB,
                         peak / GIB, batches, held.real_time,
                         held.line().removeprefix("warm-up: "),
                         steps="CUDA graphs" if graphed else "eager",
                         graphs_fallback=scheduler.graphs_fallback,
                         kernels=kernels_line(model.lm),
                         attention=attention_line(model.lm, device.type),
                         compile=model.compile_line,
                         compile_s=model.compile_s)
    return report


def report_lines(report: BenchReport) -> list[str]:
    compiled = (f" (of which {report.compile_s:.1f} s compiling the LM's step)"
                if report.compile_s else "")
    lines = [f"bench    {report.size} model, random weights, on {report.device} "
             f"({report.dtype}, quantize {report.quantize}, {report.threads} thread"
             f"{'' if report.threads == 1 else 's'}; {report.steps})",
             f"kernels  {report.kernels}",
             f"attend   {report.attention}",
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
