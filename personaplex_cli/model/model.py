"""`Model`: the PersonaPlex model on this machine.

One object per run: it knows where the files are (a folder, or a snapshot in the hub cache),
which device and precision the LM runs with, and loads each part once, on first use. Mimi
always runs in fp32; the LM in bf16 on CUDA and fp32 on CPU unless asked otherwise.
"""

from __future__ import annotations

from functools import cached_property

import torch

from ..core.lm import LMModel
from ..core.mimi import Mimi
from ..errors import InputError
from .device import default_dtype, resolve_device
from .files import ModelDir, resolve_model
from .load import load_lm, load_mimi, read_arch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return default_dtype(device)
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


class Model:
    """Resolved files + device + dtype; `mimi`, `lm` and `tokenizer` load on first use."""

    def __init__(self, files: ModelDir, device: torch.device, dtype: torch.dtype,
                 dep_steps: int | None = None):
        self.files = files
        self.device = device
        self.dtype = dtype
        # None: the assistant's depformer steps only. All of them (16) only to draw exactly
        # the random numbers NVIDIA's code draws, for seed parity of sampled runs.
        self.dep_steps = dep_steps

    @classmethod
    def open(cls, spec: str | None, device: str = "auto", dtype: str | None = None) -> "Model":
        """A repo id (from the local hub cache only, never downloading) or a folder."""
        torch_device = resolve_device(device)
        return cls(resolve_model(spec), torch_device, resolve_dtype(dtype, torch_device))

    @property
    def path(self):
        return self.files.path

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
        """The language model, with only the assistant's depformer steps built."""
        return load_lm(self.files, self.device, self.dtype, dep_steps=self.dep_steps)

    @cached_property
    def tokenizer(self):
        from ..prompts.text import TextTokenizer

        return TextTokenizer(self.files.tokenizer_file())
