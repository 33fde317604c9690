"""CUDA graphs for the per-frame work: the temporal step, the whole depformer loop with its
on-device sampling, and (optionally) Mimi's streaming encode and decode.

Every tensor a frame touches is allocated once and updated in place (KV rings, window
positions, conv histories, token rings), so one capture replays correctly for every later
frame. Capturing runs the model (warm-up, then recording), so the streaming state and the
random generator are saved before and restored after: a capture changes no result.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .generator import FrameGenerator
from .layers import WindowState
from .lm import LMModel
from .sampling import Sampling
from .streaming import StreamState


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
                 states: Sequence[StreamState], rngs: Sequence[torch.Generator] = (),
                 warmup: int = 2):
        device = inputs[0].device
        self.inputs = list(inputs)
        windows = [s for state in states for s in state.values() if isinstance(s, WindowState)]
        for window in windows:
            window.trim = False  # a graph replays fixed shapes
        written = [window.written for window in windows]
        tensors = _state_tensors(states)
        saved = [t.clone() for t in tensors]
        generators = list(rngs) or [torch.cuda.default_generators[device.index or 0]]
        rng_states = [generator.get_state() for generator in generators]

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)

        self.graph = torch.cuda.CUDAGraph()
        for rng in rngs:
            self.graph.register_generator_state(rng)
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)
        torch.cuda.synchronize(device)
        for tensor, value in zip(tensors, saved):
            tensor.copy_(value)
        for window, count in zip(windows, written):
            window.written = count
        for generator, rng_state in zip(generators, rng_states):
            generator.set_state(rng_state)

    def __call__(self, *inputs: torch.Tensor):
        for buffer, value in zip(self.inputs, inputs):
            if buffer.data_ptr() != value.data_ptr():
                buffer.copy_(value)
        self.graph.replay()
        return self.outputs


class GraphedFrameGenerator(FrameGenerator):
    """A FrameGenerator whose temporal step and depformer loop replay CUDA graphs."""

    def __init__(self, lm: LMModel, sampling: Sampling = Sampling(), *,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None,
                 window: str = "nvidia", batch: int = 1):
        super().__init__(lm, sampling, generator=generator, window=window, batch=batch)
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        alpha = lm.out_norm.alpha
        x = torch.zeros(batch, 1, alpha.shape[-1], device=self.device, dtype=alpha.dtype)
        self._temporal_graph = Graphed(super()._temporal, [x], [self.temporal])
        context, logits = self._temporal_graph.outputs
        target = self.initial.expand(batch, -1).clone()
        forced = torch.zeros(batch, lm.num_streams, dtype=torch.bool, device=self.device)
        # The depformer graph reads the temporal graph's output buffers directly.
        self._sample_graph = Graphed(super()._sample, [context, logits, target, forced],
                                     [self.depth], rngs=self.rngs)

    def _temporal(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._temporal_graph(x)

    def _sample(self, context: torch.Tensor, text_logits: torch.Tensor, target: torch.Tensor,
                forced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample_graph(context, text_logits, target, forced)


def make_generator(lm: LMModel, sampling: Sampling = Sampling(), *,
                   generator: torch.Generator | Sequence[torch.Generator] | None = None,
                   window: str = "nvidia", graphs: bool | None = None,
                   batch: int = 1) -> FrameGenerator:
    """CUDA graphs on CUDA (unless graphs=False), eager elsewhere."""
    device = next(lm.parameters()).device
    use_graphs = device.type == "cuda" if graphs is None else graphs
    cls = GraphedFrameGenerator if use_graphs else FrameGenerator
    return cls(lm, sampling, generator=generator, window=window, batch=batch)


class GraphedCodecFrames:
    """Mimi's streaming encode and decode of one 80 ms frame, each a CUDA graph."""

    def __init__(self, mimi, encoder: StreamState, decoder: StreamState, batch: int = 1):
        device = next(mimi.parameters()).device
        pcm = torch.zeros(batch, 1, mimi.frame_size, device=device)
        codes = torch.zeros(batch, mimi.num_codebooks, 1, dtype=torch.long, device=device)
        self.encode = Graphed(lambda x: mimi.encode(x, encoder), [pcm], [encoder])
        self.decode = Graphed(lambda c: mimi.decode(c, decoder), [codes], [decoder])
