"""Explicit streaming state, one row per stream.

A streaming module keeps nothing between calls itself: its carried tensors (conv history,
KV rings, positions) live in a `StreamState`, a dict from module to that module's state, made
by `StreamState.create(root, batch, dtype=...)` and passed down through `forward(x, state)`.
`state=None` means "one whole chunk, fresh history". Encoder and decoder get separate states,
so they can be interleaved frame by frame.

Every carried tensor has the batch as its first dimension, and every row is a stream of its
own: `reset(rows)` starts some rows afresh while the others go on, and `save(row)` /
`restore(row, saved)` move one stream's whole history between states (a primed persona into
a batch row). All of it happens in place, so captured CUDA graphs stay valid.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

# The options a state can be made with; each module takes the ones it needs.
STATE_OPTIONS = frozenset({"max_steps", "window", "trim"})

Rows = torch.Tensor | list[int] | None  # None: every row


class ModuleState(Protocol):
    def reset(self, rows: Rows = None) -> None: ...

    def save(self, row: int, used: int) -> Any:
        """A copy of one row's history; `used` bounds the ring slots worth keeping."""

    def restore(self, row: int, saved: Any) -> None: ...


class Streaming(nn.Module):
    """A module whose `forward(x, state)` carries history between calls."""

    def init_state(self, batch: int, device: torch.device, *, dtype: torch.dtype,
                   **options: Any) -> ModuleState:
        raise NotImplementedError


class StreamState(dict):
    """Per-module streaming states of one module tree, keyed by module."""

    @classmethod
    def create(cls, root: nn.Module, batch: int, *, dtype: torch.dtype,
               **options: Any) -> "StreamState":
        """`dtype` is what the carried tensors hold (the model's compute dtype, never a
        quantized weight's storage type)."""
        unknown = set(options) - STATE_OPTIONS
        if unknown:  # each module ignores the options it does not use: a typo would vanish
            raise TypeError(f"unknown streaming state option(s): {', '.join(sorted(unknown))}")
        device = next(root.parameters()).device
        state = cls()
        for module in root.modules():
            if isinstance(module, Streaming):
                state[module] = module.init_state(batch, device, dtype=dtype, **options)
        return state

    def reset(self, rows: Rows = None) -> None:
        """Those rows (default: all) back to a fresh start, in place."""
        for module_state in self.values():
            module_state.reset(rows)

    def save(self, row: int) -> list[Any]:
        """One row's whole history, copied out."""
        used = min((s.used_slots(row) for s in self.values() if hasattr(s, "used_slots")),
                   default=0)
        return [module_state.save(row, used) for module_state in self.values()]

    def restore(self, row: int, saved: list[Any]) -> None:
        """Makes `row` continue the stream that `save` copied (from this state or another
        made alike)."""
        for module_state, value in zip(self.values(), saved, strict=True):
            module_state.restore(row, value)

    def prefix(self, rows: int) -> "StreamState":
        """The first `rows` rows as a state of their own that shares this one's memory:
        stepping it moves those rows on, in place, and leaves the others as they were."""
        view = StreamState()
        for module, module_state in self.items():
            view[module] = first_rows(module_state, rows)
        return view


def first_rows(module_state: Any, rows: int) -> Any:
    """A shallow copy of a module state whose per-row arrays (every tensor and numpy array:
    the batch is their first dimension) are views of their first `rows` rows."""
    view = copy.copy(module_state)
    for name, value in vars(module_state).items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim:
            setattr(view, name, value[:rows])
    return view


def row_index(rows: Rows, device: torch.device) -> torch.Tensor | slice:
    """`rows` as an index along a tensor's first dimension."""
    if rows is None:
        return slice(None)
    return torch.as_tensor(rows, dtype=torch.long, device=device).view(-1)


def host_rows(rows: Rows) -> np.ndarray | slice:
    """`rows` as an index along a host (numpy) array's first dimension."""
    if rows is None:
        return slice(None)
    if isinstance(rows, torch.Tensor):
        return rows.cpu().numpy().reshape(-1)
    return np.asarray(rows, dtype=np.int64).reshape(-1)
