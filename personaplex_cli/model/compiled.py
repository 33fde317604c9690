"""--compile: the depformer's step through torch.compile, inductor's C++ backend, on the CPU.

A frame runs the depformer's steps one after another (8, each through 6 small layers and a
draw): a few thousand small tensor operations, whose dispatch, not their bytes, is most of
what the depformer adds to its kernels on a CPU (bench/depformer.py). Compiled, each
step's norms, residuals, attention bookkeeping and the quantization of int8's activation
rows become a few C++ loops around the matrix products (fbgemm's, torch's int4, or
F.linear), which stay the kernels they were.

  auto  compile where the LM runs quantized on the CPU (its rounding left the reference's
        already: compiling reorders float sums), a C++ compiler is found and the cache can
        be written; otherwise run eager, saying why with -v;
  on    compile any CPU model, unquantized ones too (their rounding then differs from the
        reference's); refused (exit 5) without a compiler or off the CPU;
  off   never.

What is compiled is cached on disk, inductor's own caches under personaplex's cache
(compiled/), keyed by torch's version, the compiler and the graph (shapes, dtype), not by
the thread count (the loops take torch's at run time): the first run on a machine compiles (minutes on 2 cores), a later one traces the steps again
and loads the compiled code (seconds). CUDA replays captured graphs instead (core/graphs.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.config import CompileMode
from ..core.lm import LMModel
from ..errors import DeviceError
from .files import tool_cache_dir


def cxx_compiler() -> str | None:
    """The C++ compiler inductor will call ($CXX, else its default: clang++ on macOS, g++
    elsewhere), where it is on the PATH."""
    name = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    return shutil.which(name)


def compile_cache() -> Path:
    return tool_cache_dir() / "compiled"


def writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


@dataclass(frozen=True)
class CompilePlan:
    """Whether this run compiles the depformer, and why, decided before anything loads."""

    mode: CompileMode
    enabled: bool
    why: str  # a phrase: what decided it
    compiler: str | None = None
    cache: Path | None = None

    def marker(self, shape: dict) -> Path:
        """The file that says a model of this `shape` (compile_shape) was compiled here once
        (inductor's caches hold the code; this only tells a first run from a later one)."""
        assert self.cache is not None
        key = dict(shape, torch=torch.__version__, compiler=self.compiler)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.cache / f"depformer-{digest}.done"

    def line(self, shape: dict) -> str:
        """The one line a run says about it, before it loads the model."""
        if not self.enabled:
            return f"compile: off ({self.why})"
        if self.marker(shape).exists():
            return f"compile: the depformer's compiled code, cached in {self.cache}"
        return (f"compile: compiling the depformer with {self.compiler}, once for this model "
                f"shape (minutes on 2 cores; cached in {self.cache} for later runs)")

    def first_time(self, shape: dict) -> bool:
        return self.enabled and not self.marker(shape).exists()


def compile_shape(lm_arch: dict, dep_steps: int, dtype: torch.dtype, quantize: str,
                  batches: tuple[int, ...]) -> dict:
    """What a compiled depformer depends on, for CompilePlan.marker."""
    return {"lm": {key: lm_arch[key] for key in sorted(lm_arch) if key.startswith("depformer")
                   or key in ("dim", "card", "text_card", "dep_q")},
            "dep_steps": dep_steps, "dtype": str(dtype), "quantize": quantize,
            "batches": list(batches)}


def plan_compile(mode: CompileMode, device: torch.device, quantize: str) -> CompilePlan:
    """--compile's decision for a run on `device` with `quantize`, or DeviceError (exit 5)
    where `on` cannot be honoured."""
    if mode == "off":
        return CompilePlan(mode, False, "--compile off")
    if device.type != "cpu":
        if mode == "on":
            raise DeviceError(f"--compile on is for the CPU; on {device.type} the frame's "
                              "work replays captured graphs: use --compile auto or off")
        return CompilePlan(mode, False, f"{device.type} replays captured graphs")
    if mode == "auto" and quantize == "none":
        return CompilePlan(mode, False, "unquantized: kept eager, bit for bit the reference's "
                           "arithmetic; --compile on compiles it")
    compiler = cxx_compiler()
    if compiler is None:
        if mode == "on":
            raise DeviceError("--compile on needs a C++ compiler (g++, or clang++ on macOS; "
                              "$CXX names another): install one, or use --compile off")
        return CompilePlan(mode, False, "no C++ compiler found")
    cache = compile_cache()
    if not writable(cache):
        if mode == "on":
            raise DeviceError(f"--compile on: cannot write the compile cache {cache}")
        return CompilePlan(mode, False, f"cannot write {cache}")
    return CompilePlan(mode, True, "a C++ compiler and a writable cache", compiler, cache)


def compile_batches(rows: int) -> tuple[int, ...]:
    """The batch sizes to compile for a run of up to `rows` rows: 1, and 2 for every larger
    batch (torch.compile compiles a size of 1 apart from the others)."""
    return (1,) if rows <= 1 else (1, 2)


def compile_depformer(lm: LMModel, plan: CompilePlan, shape: dict) -> float:
    """Makes `lm` run its depformer steps compiled, and compiles them now for each batch
    size in shape["batches"] (compile_shape) -> seconds it took. The caches go to
    plan.cache; `shape` marks them done."""
    if not plan.enabled:
        return 0.0
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(plan.cache / "inductor")
    import torch._dynamo

    # Each step's weights are its own modules: the steps are traced apart (their graphs are
    # alike, so inductor compiles one), at batch 1 and then for any batch.
    limit = 4 * lm.dep_steps
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    # Inductor's C++ loops otherwise fix the thread count they were compiled at, and its
    # cache keys by it: a later run at another count (talk's and serve's warm-ups choose
    # theirs after loading) would compile again for minutes, its line saying "cached".
    lm.depformer_compiled = torch.compile(lm.depformer_step, fullgraph=True,
                                          options={"cpp.dynamic_threads": True})
    start = time.perf_counter()
    for batch in shape["batches"]:
        run_depformer_frame(lm, batch)
    plan.marker(shape).touch()
    return time.perf_counter() - start


def run_depformer_frame(lm: LMModel, batch: int) -> torch.Tensor:
    """A frame's depformer steps on a scratch state, greedy, from a zero context -> the
    last step's logits [batch, card]. The state is made in the caller's mode and the steps
    run in inference mode, as a frame generator's: torch.compile tells inference tensors
    from others, and would compile again for the others."""
    device = next(lm.parameters()).device
    state = lm.depformer_state(batch)
    with torch.inference_mode():
        projected = lm.depformer_inputs(torch.zeros(batch, 1, lm.dim, dtype=lm.dtype,
                                                    device=device))
        prev = torch.zeros(batch, dtype=torch.long, device=device)
        step = lm.depformer_runner()
        for k in range(lm.dep_steps):
            logits = step(k, prev, projected[:, k], state, *lm.depformer_window(k, state))
            prev = logits.argmax(dim=-1)
    return logits
