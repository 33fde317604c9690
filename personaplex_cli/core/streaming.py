"""Explicit streaming state.

A streaming module keeps nothing between calls itself: its carried tensors (conv history,
KV rings, offsets) live in a `StreamState`, a dict from module to that module's state, made by
`StreamState.create(root, batch)` and passed down through `forward(x, state)`. `state=None`
means "one whole chunk, fresh history". Encoder and decoder get separate states, so they can
be interleaved frame by frame, and a state can be reset in place (CUDA-graph friendly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


# The options a state can be made with; each module takes the ones it needs.
STATE_OPTIONS = frozenset({"max_steps", "window"})


class Streaming(nn.Module):
    """A module whose `forward(x, state)` carries history between calls."""

    def init_state(self, batch: int, device: torch.device, **options: Any) -> Any:
        raise NotImplementedError


class StreamState(dict):
    """Per-module streaming states of one module tree, keyed by module."""

    @classmethod
    def create(cls, root: nn.Module, batch: int, **options: Any) -> "StreamState":
        unknown = set(options) - STATE_OPTIONS
        if unknown:  # each module ignores the options it does not use: a typo would vanish
            raise TypeError(f"unknown streaming state option(s): {', '.join(sorted(unknown))}")
        device = next(root.parameters()).device
        state = cls()
        for module in root.modules():
            if isinstance(module, Streaming):
                state[module] = module.init_state(batch, device, **options)
        return state

    def reset(self) -> None:
        """Back to a fresh start, in place."""
        for module_state in self.values():
            module_state.reset()
