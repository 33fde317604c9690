"""--compile: the LM's step through torch.compile, inductor's C++ backend, on the CPU.

A frame runs the temporal transformer once (32 layers at the 7B's size) and then the
depformer's steps one after another (8, each through 6 small layers and a draw): several
thousand small tensor operations, whose dispatch, not their bytes, is most of what the
step adds to its kernels on a CPU (bench/depformer.py, bench/floor.py). Compiled, the
layers' norms, rotations, residuals, attention bookkeeping and the quantization of int8's
activation rows become C++ loops around the matrix products (the kernels built here,
called through their C++ operators where those build: model/native.py's direct_ops;
fbgemm's, torch's int4, or F.linear) and the long attentions, which stay the kernels they
were; the depformer's short one becomes loops too (core.layers.short_attention).

  auto  compile where the LM runs quantized on the CPU (its rounding left the reference's
        already: compiling reorders float sums), a C++ compiler is found and the cache can
        be written; otherwise run eager, saying why with -v;
  on    compile any CPU model, unquantized ones too (their rounding then differs from the
        reference's); refused (exit 5) without a compiler or off the CPU;
  off   never.

Each piece is compiled ahead of time into a function called without torch.compile's
guards: dynamo would check a few hundred of them (the model's modules, the KV rings)
before every call, 0.3 to 1.7 ms, more than a depformer step's own loops. The depformer's
steps, each with its draw and with the code between its kernels in C++ too, are compiled
once for one row and once for any larger batch, and CompiledSteps tells the steps and the
batch sizes apart; the temporal transformer's step once, for one row on the conversation
window (CompiledTemporal; larger batches run it eager). The functions are
saved under personaplex's cache (compiled/), one folder per model shape, torch version,
compiler, options and source (STEP_SOURCES): the first run on a machine compiles (four
to five minutes on 2 cores at the real size), a later one loads them (seconds). Their
loops take torch's thread count at run time. CUDA replays captured graphs instead
(core/graphs.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import core
from ..core.config import CONVERSATION_WINDOW, CompileMode
from ..core.lm import LMModel
from ..core.quantize import linear_kernels
from ..errors import DeviceError
from .files import tool_cache_dir
from .native import OP_SOURCE, direct_ops, native_bf16_for, native_kernel_for


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

    def folder(self, shape: dict) -> Path:
        """Where the steps of a model of this `shape` (compile_shape), compiled by this
        torch and compiler from this source of the step, are saved."""
        assert self.cache is not None
        key = dict(shape, torch=torch.__version__, compiler=self.compiler,
                   source=step_source_digest(), options=saved_options())
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.cache / f"lm-{digest}"

    def line(self, shape: dict) -> str:
        """The one line a run says about it, before it loads the model."""
        if not self.enabled:
            return f"compile: off ({self.why})"
        if not self.first_time(shape):
            return f"compile: the LM's compiled step, cached in {self.cache}"
        return (f"compile: compiling the LM's step with {self.compiler}, once for this model "
                f"shape (up to five minutes on 2 cores; saved in {self.cache} for later runs)")

    def first_time(self, shape: dict) -> bool:
        if not self.enabled:
            return False
        folder = self.folder(shape)
        return not (temporal_file(folder).exists() and all(
            step_file(folder, batch, step).exists() for batch in shape["batches"]
            for step in range(shape["dep_steps"])))


def compile_shape(lm_arch: dict, dep_steps: int, dtype: torch.dtype, quantize: str,
                  batches: tuple[int, ...]) -> dict:
    """What the compiled step depends on, for CompilePlan.folder: the kernels built here
    too (the compiled code calls them by name)."""
    cpu = torch.device("cpu")
    native = native_kernel_for(cpu, quantize) is not None
    tiled = native_bf16_for(cpu, quantize, dtype) is not None
    # called through their C++ operators, as compile_lm will where they build (where they
    # do not, it keys the code it compiles without them)
    return {"lm": dict(sorted(lm_arch.items())), "dep_steps": dep_steps, "dtype": str(dtype),
            "quantize": quantize, "int8_kernel": int8_kernel_key(native, tiled, True),
            "batches": list(batches), "window": CONVERSATION_WINDOW}


def int8_kernel_key(native: bool, tiled: bool, direct: bool) -> str:
    """compile_shape's name for the kernels the compiled code calls: int8's, whether the
    bf16 linears are the kernel built here (tile_bf16_linears), and whether the kernels
    built here are called through their C++ operators (native.direct_ops)."""
    key = ("native" if native else "torch's") + (" + bf16 tiles" if tiled else "")
    return key + (" + C++ operators" if direct and (native or tiled) else "")


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
    if not saves_compiled_functions():
        if mode == "on":
            raise DeviceError(f"--compile on needs a torch that compiles ahead of time "
                              f"(torch.compiler.load_compiled_function; this is "
                              f"{torch.__version__}): upgrade torch, or use --compile off")
        return CompilePlan(mode, False, f"torch {torch.__version__} cannot save compiled code")
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


# Inductor's C++ loops otherwise fix the thread count they were compiled at: a later run at
# another count (talk's and serve's warm-ups choose theirs after loading) would be slower,
# or compile again. No guards are built: CompiledSteps and CompiledTemporal pick the
# function themselves.
# Nor are the buffers' sizes checked at each call (size_asserts): they are the ones traced,
# and the checks took a few hundred microseconds of a depformer step.
# (Passed as a copy: torch.compile takes guard_filter_fn out of the options it is given.)
COMPILE_OPTIONS = {"cpp.dynamic_threads": True, "size_asserts": False,
                   "guard_filter_fn": lambda guards: [False] * len(guards)}
# The depformer's steps run the code between their kernels as C++ too (cpp_wrapper), not as
# a Python function's lines: at the real size that took 2.5 ms off a 35 ms int8 frame. The
# temporal step keeps the Python wrapper: in C++ it compiled in 154 s for 58 and ran no
# faster (a 400 ms step).
STEP_OPTIONS = dict(COMPILE_OPTIONS, cpp_wrapper=True)
# The files of core/ the compiled code was traced through: it is saved per their source,
# so a changed step compiles again.
STEP_SOURCES = ("lm.py", "layers.py", "quantize.py", "sampling.py", "streaming.py")


def saved_options() -> dict:
    """The options that shape the saved code (the guards' filter builds none)."""
    return {piece: {name: value for name, value in options.items() if not callable(value)}
            for piece, options in (("temporal", COMPILE_OPTIONS), ("steps", STEP_OPTIONS))}


def saves_compiled_functions() -> bool:
    """Whether this torch compiles a function ahead of time and saves it (2.13 is tested)."""
    return hasattr(torch.compiler, "load_compiled_function")


def step_source_digest() -> str:
    """The step's sources, and the C++ operators' (compiled code calls them by their
    signatures there)."""
    digest = hashlib.sha256()
    for name in STEP_SOURCES:
        digest.update((Path(core.__file__).parent / name).read_bytes())
    digest.update(OP_SOURCE.read_bytes())
    return digest.hexdigest()[:16]


def step_file(folder: Path, batch: int, step: int) -> Path:
    """The saved depformer step `step` for one row (batch 1) or any larger batch (2)."""
    return folder / f"{'one-row' if batch == 1 else 'rows'}-step{step}.bin"


def temporal_file(folder: Path) -> Path:
    return folder / "temporal-one-row.bin"


class CompiledSteps:
    """The depformer's steps with their draws as compiled functions, by (step, batch of one
    row or more); called as LMModel.depformer_draw is, with its tensors laid out as the
    frame generator's (compile_steps traces them so). A batch size nothing was compiled
    for (the run said it would step fewer rows: Model.compile_for) runs eager, and so does
    a draw over the whole vocabulary (a row without top-k: RowChoice.take_all), which the
    compiled draw was not traced through."""

    def __init__(self, lm: LMModel, functions: dict[tuple[int, bool], object]):
        self.lm = lm
        self.functions = functions

    def __call__(self, step: int, prev_token: torch.Tensor, projected: torch.Tensor, state,
                 slot: torch.Tensor, seen: torch.Tensor, choice, *frame: torch.Tensor):
        """frame: the draw's noise, forced rows and targets (LMModel.depformer_draw)."""
        args = (step, prev_token, projected, state, slot, seen, choice, *frame)
        function = self.functions.get((step, prev_token.shape[0] > 1))
        if function is None or choice.take_all is not None:
            return self.lm.depformer_draw(*args)
        return function(self.lm, *args)


class CompiledTemporal:
    """The temporal transformer's step as a compiled function, called as
    LMModel.forward_embeddings is: for one row and one step over the window it was
    compiled for (its size, kind and trimming are constants of the compiled code); anything
    else runs eager."""

    def __init__(self, lm: LMModel, function, window: tuple):
        self.lm = lm
        self.function = function
        self.window = window

    def __call__(self, x: torch.Tensor, state) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[:2] == (1, 1) and window_of(state[self.lm.transformer]) == self.window:
            return self.function(self.lm, x, state)
        return self.lm.forward_embeddings(x, state)


def window_of(positions) -> tuple:
    """What compiled code takes as constants of a transformer's WindowState."""
    return (positions.capacity, positions.context, positions.window, positions.group,
            positions.trim)


def compile_lm(lm: LMModel, plan: CompilePlan, shape: dict) -> float:
    """Makes `lm` run its temporal step (one row) and its depformer steps (each batch size
    in shape["batches"]: compile_shape) compiled: loaded from plan.cache, or compiled now
    and saved there -> seconds it took."""
    if not plan.enabled:
        return 0.0
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(plan.cache / "inductor")
    # the kernel the layers took, as compile_shape foresaw it unless a build failed since
    kernels = linear_kernels(lm, everywhere=True)
    native, tiled = "native" in kernels, "tiled" in kernels
    direct = (native or tiled) and direct_ops(plan.compiler) is None
    folder = plan.folder(dict(shape, int8_kernel=int8_kernel_key(native, tiled, direct)))
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    functions = {}
    for batch in shape["batches"]:
        files = [step_file(folder, batch, step) for step in range(lm.dep_steps)]
        steps = loaded_or_compiled(files, lambda: compile_steps(lm, batch, files))
        functions.update(((step, batch > 1), function) for step, function in enumerate(steps))
    file = temporal_file(folder)
    [temporal] = loaded_or_compiled([file], lambda: compile_temporal(lm, file))
    # The window a frame generator's temporal state has for one row (its positions alone:
    # the KV rings, 1.6 GB at the 7B's size, are made only to compile).
    positions = lm.transformer.init_state(1, next(lm.parameters()).device, dtype=lm.dtype,
                                          window=CONVERSATION_WINDOW)
    lm.depformer_compiled = CompiledSteps(lm, functions)
    lm.temporal_compiled = CompiledTemporal(lm, temporal, window_of(positions))
    return time.perf_counter() - start


def operators_line(lm: LMModel, plan: CompilePlan) -> str | None:
    """Once `lm` is compiled: how its compiled code reaches the kernels built here (through
    their C++ operators, or through Python and why), for -v; None where it calls none."""
    if not plan.enabled or lm.depformer_compiled is None:
        return None
    kernels = linear_kernels(lm, everywhere=True)
    if "native" not in kernels and "tiled" not in kernels:
        return None
    why = direct_ops(plan.compiler)  # cached: the answer compile_lm had
    if why is None:
        return "compile: the compiled step calls the kernels built here through C++ operators"
    return f"compile: the compiled step calls the kernels built here through Python ({why})"


def loaded_or_compiled(files: list[Path], compile_them) -> list:
    """The functions saved in `files`, or compile_them()'s where one cannot be loaded;
    inductor failing is a DeviceError of one line (exit 5)."""
    functions = load_steps(files) if all(file.exists() for file in files) else None
    if functions is not None:
        return functions
    try:
        return compile_them()
    except Exception as error:  # inductor's own, many kinds
        first = str(error).splitlines()[0] if str(error) else ""
        raise DeviceError(f"compiling the LM's step failed ({type(error).__name__}: {first}); "
                          "use --compile off") from error


def compile_temporal(lm: LMModel, file: Path) -> list:
    """The temporal transformer's step for one row, traced on a scratch state made as a
    frame generator makes it, saved to `file` -> [the function]."""
    state = lm.temporal_state(1, CONVERSATION_WINDOW)
    with torch.inference_mode():
        x = torch.zeros(1, 1, lm.dim, dtype=lm.dtype, device=next(lm.parameters()).device)
        return [compile_saved(type(lm).forward_embeddings, (lm, x, state), file,
                              COMPILE_OPTIONS)]


def compile_saved(function, args: tuple, file: Path, options: dict):
    """`function` compiled ahead of time for `args` with inductor's `options`, to be called
    without guards, and saved to `file`."""
    with warnings.catch_warnings():
        # dynamo traces through core.layers.bag_rows' cache, as it should: the index
        # tensors it makes depend on their sizes alone
        warnings.filterwarnings("ignore", "Dynamo detected a call to a `functools.lru_cache`")
        compiled = torch.compile(function, fullgraph=True, options=dict(options)
                                 ).aot_compile((args, {}))
    compiled.disable_guard_check()
    compiled.save_compiled_function(str(file))
    return compiled


def load_steps(files: list[Path]) -> list | None:
    """The saved steps, or None where one cannot be loaded (written by another build of
    the same torch version, say): they are compiled again."""
    functions = []
    for file in files:
        try:
            with open(file, "rb") as stream:
                function = torch.compiler.load_compiled_function(stream)
        except Exception:  # whatever unpickling a foreign file raises
            return None
        function.disable_guard_check()
        functions.append(function)
    return functions


def compile_steps(lm: LMModel, batch: int, files: list[Path]) -> list:
    """Each depformer step with its draw compiled for batches of `batch` rows (1; 2 stands
    for any larger batch: its size is left symbolic) and any top-k (the noise's width is
    symbolic too), traced on a scratch frame as the frame generator runs it, saved to
    `files` -> the functions."""
    import torch._dynamo

    device = next(lm.parameters()).device
    state = lm.depformer_state(batch)
    functions = []
    with torch.inference_mode():
        projected = lm.depformer_inputs(torch.zeros(batch, 1, lm.dim, dtype=lm.dtype,
                                                    device=device))
        prev = torch.zeros(batch, dtype=torch.long, device=device)
        choice, noise, forced, target = scratch_draws(lm, batch, greedy=False)
        torch._dynamo.mark_dynamic(noise, 2)
        torch._dynamo.mark_dynamic(choice.keep, 1)
        for step, file in enumerate(files):
            args = (lm, step, prev, projected[:, step], state,
                    *lm.depformer_window(step, state), choice, noise, forced, target)
            if batch > 1:
                for tensor in batch_tensors(prev, projected[:, step], state, choice, noise,
                                            forced, target):
                    torch._dynamo.mark_dynamic(tensor, 0)
            function = compile_saved(type(lm).depformer_draw, args, file, STEP_OPTIONS)
            functions.append(function)
            prev = function(*args)[2]
    return functions


def scratch_draws(lm: LMModel, batch: int, greedy: bool) -> tuple:
    """What a frame's depformer draws read, for `batch` rows at temperature 1 (greedy or
    not), laid out as the frame generator lays them out, as compiled steps need them (they
    read their inputs with the strides traced): (choice, the frame's noise [B, dep_steps,
    W], the codebooks' columns of the frame's forced rows and targets [B, num_streams]).
    W is NVIDIA's default top-k: any width below the vocabulary would do (at the
    vocabulary the draw takes another path, which CompiledSteps runs eager)."""
    from ..core.sampling import RowChoice, Sampling

    device = next(lm.parameters()).device
    width = min(Sampling().top_k_audio, lm.card - 1)
    choice = RowChoice(torch.ones(batch, device=device),
                       torch.full((batch,), width, device=device),
                       torch.full((batch,), greedy, device=device), lm.card, width)
    columns = (batch, lm.num_streams)
    return (choice, torch.ones(batch, lm.dep_steps, width, device=device),
            torch.zeros(columns, dtype=torch.bool, device=device)[:, 1:],
            torch.zeros(columns, dtype=torch.long, device=device)[:, 1:])


def batch_tensors(prev: torch.Tensor, projected: torch.Tensor, state, choice,
                  noise: torch.Tensor, forced: torch.Tensor, target: torch.Tensor
                  ) -> list[torch.Tensor]:
    """What a step and its draw read whose first dimension is the batch's rows: the
    previous tokens, the projection, every tensor of the depformer's module states (rings,
    positions), the draw's parameters, its noise and the forced rows' tokens."""
    tensors = [prev, projected, choice.temp, choice.keep, choice.greedy, noise, forced,
               target]
    for module_state in state.values():
        tensors += [value for value in vars(module_state).values()
                    if isinstance(value, torch.Tensor)]
    return tensors

