"""CUDA graphs for the per-frame work: the temporal step, the whole depformer loop with its
sampling, and Mimi's streaming encode and decode.

Every tensor a frame touches is allocated once and updated in place (KV rings, window
positions, conv histories, token rings, the rows' sampling parameters and noise), so one
capture of a batch replays correctly for every later frame, whoever sits in which row: rows
join, leave and are primed by writing into those tensors, never by capturing again.
Capturing runs the model (warm-up, then recording), so the streaming state is saved before
and restored after: a capture changes no result. The depformer graph makes the keyed rows'
noise too (sampling.RowSampling.with_keyed, from the rows' keys and frame offsets, tensors
updated in place); the draws of a row with a generator happen before, outside the graphs
(RowSampling.draw_generators), so no generator is captured.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .generator import FrameGenerator
from .layers import WindowState
from .lm import LMModel
from .streaming import StreamState


def use_graphs(device: torch.device, requested: bool | None = None) -> bool:
    """Whether per-frame work replays CUDA graphs: by default on CUDA, never elsewhere."""
    if requested and device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    return device.type == "cuda" if requested is None else requested


def _state_tensors(states: Sequence[StreamState]) -> list[torch.Tensor]:
    return [value for state in states for module_state in state.values()
            for value in vars(module_state).values() if isinstance(value, torch.Tensor)]


class Graphed:
    """`fn(*inputs)` captured once on static input buffers; calls copy in and replay.

    The outputs are the graph's own buffers, overwritten by the next replay. The example
    inputs become the input buffers (pass tensors nothing else writes to, or another
    graph's outputs to chain graphs without a copy).
    """

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor],
                 states: Sequence[StreamState], warmup: int = 2):
        device = inputs[0].device
        self.inputs = list(inputs)
        windows = [s for state in states for s in state.values() if isinstance(s, WindowState)]
        for window in windows:
            window.trim = False  # a graph replays fixed shapes
        written = [window.written.copy() for window in windows]
        tensors = _state_tensors(states)
        saved = [t.clone() for t in tensors]

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)

        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)
        torch.cuda.synchronize(device)
        for tensor, value in zip(tensors, saved):
            tensor.copy_(value)
        for window, count in zip(windows, written):
            window.written[:] = count

    def __call__(self, *inputs: torch.Tensor):
        for buffer, value in zip(self.inputs, inputs):
            if buffer.data_ptr() != value.data_ptr():
                buffer.copy_(value)
        self.graph.replay()
        return self.outputs


# Noise widths a graphed generator is captured with (text, audio): the widest top-k a row may
# ask for. Audio covers the whole codebook, so any audio top-k works; text covers ten times
# NVIDIA's default of 25.
GRAPH_NOISE_WIDTHS = (250, 2048)


class GraphedFrameGenerator(FrameGenerator):
    """A FrameGenerator whose temporal step and depformer loop replay CUDA graphs."""

    def __init__(self, lm: LMModel, batch: int = 1, **options):
        if next(lm.parameters()).device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        widths = tuple(min(w, v) for w, v in zip(GRAPH_NOISE_WIDTHS, (lm.text_card, lm.card)))
        super().__init__(lm, batch, noise_widths=widths, **options)
        self.sampling.every_frame = True  # the graph makes keyed noise whoever sits where
        x = torch.zeros(batch, 1, lm.dim, device=self.device, dtype=lm.dtype)
        self._temporal_graph = Graphed(super()._temporal, [x], [self.temporal])
        context, logits = self._temporal_graph.outputs
        target = self.initial.expand(batch, -1).clone()
        forced = torch.zeros(batch, lm.num_streams, dtype=torch.bool, device=self.device)
        # The depformer graph reads the temporal graph's output buffers directly.
        self._sample_graph = Graphed(
            super()._sample, [context, logits, target, forced, *self.sampling.noise],
            [self.depth])

    def _temporal(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._temporal_graph(x)

    def _sample(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._sample_graph(*inputs)


def make_generator(lm: LMModel, batch: int = 1, *, graphs: bool | None = None,
                   **options) -> FrameGenerator:
    """CUDA graphs on CUDA (unless graphs=False), eager elsewhere; eager fp32 attends over
    the written KV slots only."""
    device = next(lm.parameters()).device
    if use_graphs(device, graphs):
        return GraphedFrameGenerator(lm, batch, **options)
    return FrameGenerator(lm, batch, trim=lm.dtype == torch.float32, **options)


class GraphedCodecFrames:
    """Mimi's streaming encode and decode of one 80 ms frame, each a CUDA graph."""

    def __init__(self, mimi, encoder: StreamState, decoder: StreamState, batch: int = 1):
        device = next(mimi.parameters()).device
        pcm = torch.zeros(batch, 1, mimi.frame_size, device=device)
        codes = torch.zeros(batch, mimi.num_codebooks, 1, dtype=torch.long, device=device)
        self.encode = Graphed(lambda x: mimi.encode(x, encoder), [pcm], [encoder])
        self.decode = Graphed(lambda c: mimi.decode(c, decoder), [codes], [decoder])
