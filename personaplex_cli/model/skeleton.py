"""Modules built for their shapes alone: on the meta device, with torch's parameter
initialisers skipped.

Loading, the memory count and doctor --bench build the LM and Mimi before their tensors
exist. On the meta device no memory is taken, but torch still runs each module's
initialiser, and its meta `normal_` goes through torch._refs, whose first call imports
torch._dynamo: on a 2-core machine 1.2 s of every load, and 2.9 s in all for the three
builds of a tiny `reply` (the 7B's memory count alone: 1.38 s, 0.14 s without). Every
tensor built here is replaced or only measured, so nothing is lost by leaving it
uninitialised.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode


class _SkipInitialisers(TorchFunctionMode):
    """Answers each torch.nn.init function with its tensor, untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextmanager
def shapes_only():
    """Modules built inside have meta tensors, never initialised."""
    with torch.device("meta"), _SkipInitialisers():
        yield
