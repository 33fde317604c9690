"""`Model`: the PersonaPlex model on this machine.

One object per run: it knows where the files are (a folder, or a snapshot in the hub cache),
which device, precision and weight quantization the LM runs with, and loads each part once,
on first use. `preflight()` checks, before anything is loaded, that the files fit each other
and the run fits the device's memory. Mimi always runs in fp32; the LM by default in bf16
on CUDA and on CPUs that compute bf16 natively, else fp32 (model/device.py).
"""

from __future__ import annotations

from functools import cached_property

import torch

from ..core.config import COMPILE_MODES, DEFAULT_COMPILE, QUANTIZE_MODES, CompileMode, Quantize
from ..core.lm import LMModel
from ..core.mimi import Mimi
from ..errors import InputError
from .device import DTYPES, check_graphs, check_quantize, default_dtype, resolve_device
from .files import ModelDir, resolve_model
from .load import check_files_agree, lm_plan, load_lm, load_mimi, read_arch
from .memory import (MemoryNeed, available_bytes, check_fits, memory_need,
                     sessions_that_fit)

def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return default_dtype(device)
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


class Model:
    """Resolved files + device + dtype + quantization; `mimi`, `lm` and `tokenizer` load on
    first use."""

    def __init__(self, files: ModelDir, device: torch.device, dtype: torch.dtype,
                 dep_steps: int | None = None, quantize: Quantize = "none",
                 graphs: bool | None = None, compile_mode: CompileMode = DEFAULT_COMPILE):
        if quantize not in QUANTIZE_MODES:
            raise InputError(f"unknown quantization {quantize!r}; expected one of "
                             f"{', '.join(QUANTIZE_MODES)}")
        if compile_mode not in COMPILE_MODES:
            raise InputError(f"unknown --compile {compile_mode!r}; expected one of "
                             f"{', '.join(COMPILE_MODES)}")
        check_quantize(device, quantize, dtype)
        check_graphs(device, graphs)
        from .compiled import plan_compile

        # Decided now, before anything loads: --compile on that cannot be is refused here.
        self.compile_plan = plan_compile(compile_mode, device, quantize)
        self.compile_rows = 1  # the most rows a step of this run takes (compile_for)
        self.files = files
        self.device = device
        self.dtype = dtype
        self.quantize = quantize
        # CUDA graphs for the engines made for this model: None where they can be captured
        # (falling back to eager steps when a capture fails), True required, False never.
        self.graphs = graphs
        # None: the assistant's depformer steps only. All of them (16) only to draw exactly
        # the random numbers NVIDIA's code draws, for seed parity of sampled runs.
        self.dep_steps = dep_steps

    @classmethod
    def open(cls, spec: str | None, device: str = "auto", dtype: str | None = None,
             quantize: Quantize = "none", graphs: bool | None = None,
             compile_mode: CompileMode = DEFAULT_COMPILE) -> "Model":
        """A repo id (from the local hub cache only, never downloading) or a folder."""
        torch_device = resolve_device(device)
        return cls(resolve_model(spec), torch_device, resolve_dtype(dtype, torch_device),
                   quantize=quantize, graphs=graphs, compile_mode=compile_mode)

    def compile_for(self, rows: int) -> tuple[str, bool]:
        """This run steps up to `rows` rows at once -> (the line that says what --compile
        will do when the LM loads, whether that is compiling: minutes, once)."""
        self.compile_rows = rows
        shape = self._compile_shape()
        return self.compile_plan.line(shape), self.compile_plan.first_time(shape)

    def int8_kernel_line(self) -> str | None:
        """Which kernels built here a quantized LM takes and why (model/native.py), or None
        where it takes none of its choosing."""
        from .native import native_line

        return native_line(self.device, self.quantize, self.dtype)

    def compiled_operators_line(self) -> str | None:
        """Once the LM has loaded: how its compiled step reaches the kernels built here
        (model/compiled.py's operators_line), or None."""
        from .compiled import operators_line

        return operators_line(self.lm, self.compile_plan)

    def _compile_shape(self) -> dict:
        """What the compiled code depends on, from the architecture file alone (no weight
        file is read: reply checks its inputs first)."""
        from .compiled import compile_batches, compile_shape
        from .memory import default_dep_steps

        lm_arch = self.arch.lm
        dep_steps = self.dep_steps or default_dep_steps(lm_arch)
        return compile_shape(lm_arch, dep_steps, self.dtype, self.quantize,
                             compile_batches(self.compile_rows))

    @property
    def path(self):
        return self.files.path

    def preflight(self, streams: int = 1, streams_option: str | None = None,
                  available: int | None = None) -> MemoryNeed:
        """Before any weight is read: files that do not fit each other (exit 6), then a run
        of `streams` streams that does not fit the device (exit 5, naming the option that
        would make it fit; `streams_option` is the one that sets the streams)."""
        arch, lm_arch, dep_steps, _ = lm_plan(self.files, self.dep_steps)
        check_files_agree(arch, lm_arch, self.tokenizer.pieces,
                          self.files.tokenizer_file().name)
        return check_fits(arch, lm_arch, dep_steps, self.device, self.dtype, self.quantize,
                          streams, streams_option, available, graphs=self.graphs)

    def sessions_that_fit(self, available: int | None = None) -> int | None:
        """How many conversations at once this device's memory holds beside the model (its
        free GPU memory or available RAM now, or `available` bytes), before loading; None
        where the device cannot tell. For a server sizing --max-sessions."""
        arch, lm_arch, dep_steps, _ = lm_plan(self.files, self.dep_steps)
        need = memory_need(arch, lm_arch, dep_steps, self.device, self.dtype, self.quantize,
                           graphs=self.graphs)
        have = available_bytes(self.device) if available is None else available
        return None if have is None else sessions_that_fit(need, have)

    @property
    def lm_arch(self) -> dict:
        """The LM's dimensions as the checkpoint has them (read without loading it)."""
        return lm_plan(self.files, self.dep_steps)[1]

    @cached_property
    def arch(self):
        """The architecture (core.config.Arch), read without loading any weights."""
        return read_arch(self.files)

    @cached_property
    def _mimi(self) -> tuple[Mimi, str]:
        return load_mimi(self.files, self.device)

    @property
    def mimi(self) -> Mimi:
        return self._mimi[0]

    @property
    def mimi_sha256(self) -> str:
        """Identifies the codec weights (written into code files, checked on decode)."""
        return self._mimi[1]

    @cached_property
    def lm(self) -> LMModel:
        """The language model, with only the assistant's depformer steps built, its
        step compiled where --compile says so (model/compiled.py)."""
        from .compiled import compile_lm

        lm = load_lm(self.files, self.device, self.dtype, dep_steps=self.dep_steps,
                     quantize=self.quantize)
        compile_lm(lm, self.compile_plan, self._compile_shape())
        return lm

    @cached_property
    def tokenizer(self):
        from .tokenizer import TextTokenizer

        return TextTokenizer(self.files.tokenizer_file())
