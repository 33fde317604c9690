"""CUDA graphs for the per-frame work: the temporal step, the whole depformer loop with its
sampling, and Mimi's streaming encode and decode.

Every tensor a frame touches is allocated once and updated in place (KV rings, window
positions, conv histories, token rings, the rows' sampling parameters and noise), so one
capture replays correctly for every later frame, whoever sits in which row: rows join,
leave and are primed by writing into those tensors, never by capturing again. Nothing a
replayed step needs lives on the host (a replay runs no Python): a window's fill is its
device offset (core.layers.WindowState).

Capturing runs the step (warm-up, then recording), on rows that hold no stream yet: an
engine captures as it is made. The rows are started afresh before and after (their
positions and conv histories reset, as when a stream leaves), so a capture copies and
restores nothing: the ring slots it wrote hold positions no mask admits, like the slots
of any row a stream has left. It runs under the model's device (`cuda:N`), on a capture
stream made there.

A graph computes its whole batch, so there is one set of graphs per live count: batches
of 1, 2, 4 ... rows up to the capacity (`live_buckets`), captured largest first in one
memory pool (only one replays at a time); a step replays the smallest that covers the rows
up to the last live one, as an eager step computes only those (FrameGenerator.rows_for).

The depformer graph makes the keyed rows' noise too (sampling.RowSampling.with_keyed, from
the rows' keys and frame offsets, tensors updated in place); the draws of a row with a
generator happen before, outside the graphs (RowSampling.draw_generators), so no generator
is captured.
"""

from __future__ import annotations

import functools
import gc
from typing import Callable, Sequence, TypeVar

import torch

from .generator import FrameGenerator
from .layers import WindowState
from .lm import LMModel
from .streaming import StreamState


# Runs of a step before its capture, on a side stream: the first calls of a kernel allocate
# workspaces and handles, which must not be recorded (as torch's CUDA graph notes advise).
CAPTURE_WARMUP = 2


class CaptureError(RuntimeError):
    """A graph could not be captured (the device refused, or ran out of memory)."""


def live_buckets(capacity: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured at: 1, 2, 4 ... below `capacity`, and it."""
    sizes, n = [], 1
    while n < capacity:
        sizes.append(n)
        n *= 2
    return tuple(sizes + [capacity])


def covering(buckets: Sequence[int], rows: int) -> int:
    """The smallest of `buckets` that holds `rows` rows."""
    return min(size for size in buckets if size >= rows)


T = TypeVar("T")


def new_pool(device: torch.device):
    """A memory pool for the graphs of one engine (only one of them replays at a time)."""
    return Graphed.new_pool(device)


def use_graphs(device: torch.device, requested: bool | None = None) -> bool:
    """Whether per-frame work replays CUDA graphs: by default where graphs can be captured
    (CUDA), never elsewhere."""
    where = device.type in Graphed.devices
    if requested and not where:
        raise ValueError("CUDA graphs need a CUDA device")
    return where if requested is None else requested


_CAPTURE_STREAMS: dict = {}


def _capture_stream(device: torch.device):
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


class Graphed:
    """`fn(*inputs)` captured once on static input buffers; calls copy in and replay.

    The outputs are the graph's own buffers, overwritten by the next replay. The example
    inputs become the input buffers (pass tensors nothing else writes to, or another
    graph's outputs to chain graphs without a copy). `states` are the streaming states the
    step moves: their rows are started afresh before and after the capture (the module's
    note), so pass the states of rows that hold no stream.
    """

    devices: tuple[str, ...] = ("cuda",)  # where a graph is captured (a test double adds more)

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor],
                 states: Sequence[StreamState], *, pool=None, warmup: int | None = None):
        self.device = inputs[0].device
        self.inputs = list(inputs)
        self._states = list(states)
        with self.on_device(self.device):
            self._afresh()
            try:
                self.outputs = self._capture(fn, pool, CAPTURE_WARMUP if warmup is None
                                             else warmup)
            except RuntimeError as error:  # torch.OutOfMemoryError is one
                raise CaptureError(" ".join(str(error).split()) or type(error).__name__) from error
            finally:
                self._afresh()

    @staticmethod
    def on_device(device: torch.device):
        return torch.cuda.device(device)

    @classmethod
    def new_pool(cls, device: torch.device):
        with cls.on_device(device):
            return torch.cuda.graph_pool_handle()

    def _afresh(self) -> None:
        for state in self._states:
            for window in state.values():
                if isinstance(window, WindowState):
                    window.trim = False  # a graph replays fixed shapes
            state.reset()

    def _capture(self, fn: Callable, pool, warmup: int):
        # Warm-up and capture on one stream made on the model's device, for every graph
        # there (torch.cuda.graph's default stream is made once, on whichever device was
        # current then; cuBLAS keeps a workspace per stream, made at the warm-up).
        stream = _capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(warmup):
                fn(*self.inputs)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool, stream=stream):
            outputs = fn(*self.inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        return outputs

    def _replay(self) -> None:
        self.graph.replay()

    def __call__(self, *inputs: torch.Tensor):
        for buffer, value in zip(self.inputs, inputs):
            if buffer.data_ptr() != value.data_ptr():
                buffer.copy_(value)
        with self.on_device(self.device):
            self._replay()
        return self.outputs


# Noise widths a graphed generator is captured with (text, audio): the widest top-k a row may
# ask for. Audio covers the whole codebook, so any audio top-k works; text covers ten times
# NVIDIA's default of 25.
GRAPH_NOISE_WIDTHS = (250, 2048)


class GraphedFrameGenerator(FrameGenerator):
    """A FrameGenerator whose temporal step and depformer loop replay CUDA graphs, one pair
    per live count (`live_buckets`); `first_rows(n)` takes a count's own graphs."""

    def __init__(self, lm: LMModel, batch: int = 1, *, pool=None, **options):
        if next(lm.parameters()).device.type not in Graphed.devices:
            raise ValueError("CUDA graphs need a CUDA device")
        widths = tuple(min(w, v) for w, v in zip(GRAPH_NOISE_WIDTHS, (lm.text_card, lm.card)))
        super().__init__(lm, batch, noise_widths=widths, **options)
        self.sampling.every_frame = True  # the graph makes keyed noise whoever sits where
        self.buckets = live_buckets(batch)
        pool = new_pool(self.device) if pool is None else pool
        # Captured on views made before `_graphs` is set, so that no graph's step holds the
        # graphs (a reference cycle would keep the rows' memory until the collector ran).
        graphs = {rows: self._capture(FrameGenerator.first_rows(self, rows), pool)
                  for rows in sorted(self.buckets, reverse=True)}  # the others reuse its pool
        self._graphs: dict[int, tuple[Graphed, Graphed]] = graphs

    def _capture(self, view: FrameGenerator, pool) -> tuple[Graphed, Graphed]:
        rows = view.batch
        x = torch.zeros(rows, 1, self.lm.dim, device=self.device, dtype=self.lm.dtype)
        temporal = Graphed(functools.partial(FrameGenerator._temporal, view), [x],
                           [view.temporal], pool=pool)
        context, logits = temporal.outputs
        target = self.initial.expand(rows, -1).clone()
        forced = torch.zeros(rows, self.lm.num_streams, dtype=torch.bool, device=self.device)
        # The depformer graph reads the temporal graph's output buffers directly, and the
        # noise buffers' first rows, which RowSampling draws into.
        noise = [buffer[:rows] for buffer in self.sampling.noise]
        sample = Graphed(functools.partial(FrameGenerator._sample, view),
                         [context, logits, target, forced, *noise], [view.depth], pool=pool)
        return temporal, sample

    def rows_for(self, rows: int) -> int:
        return covering(self.buckets, rows)

    def first_rows(self, rows: int) -> FrameGenerator:
        if rows not in self.buckets:
            raise ValueError(f"no graphs for {rows} rows (captured: {self.buckets})")
        return super().first_rows(rows)

    def _temporal(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._graphs[self.batch][0](x)

    def _sample(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._graphs[self.batch][1](*inputs)


def make_generator(lm: LMModel, batch: int = 1, *, graphs: bool | None = None, pool=None,
                   **options) -> FrameGenerator:
    """CUDA graphs on CUDA (unless graphs=False), eager elsewhere; eager fp32 attends over
    the written KV slots only, unless its temporal step is compiled (model/compiled.py),
    which, like a replayed graph, reads the whole ring."""
    device = next(lm.parameters()).device
    if use_graphs(device, graphs):
        return GraphedFrameGenerator(lm, batch, pool=pool, **options)
    trim = lm.dtype == torch.float32 and lm.temporal_compiled is None
    return FrameGenerator(lm, batch, trim=trim, **options)


class GraphedCodecFrames:
    """Mimi's streaming encode and decode of one 80 ms frame, each a CUDA graph, for every
    live count: `encode[rows]` and `decode[rows]` step the first `rows` rows."""

    def __init__(self, mimi, encoder: StreamState, decoder: StreamState, batch: int = 1, *,
                 pool=None):
        device = next(mimi.parameters()).device
        self.encode: dict[int, Graphed] = {}
        self.decode: dict[int, Graphed] = {}
        for rows in sorted(live_buckets(batch), reverse=True):
            enc, dec = encoder.prefix(rows), decoder.prefix(rows)
            pcm = torch.zeros(rows, 1, mimi.frame_size, device=device)
            codes = torch.zeros(rows, mimi.num_codebooks, 1, dtype=torch.long, device=device)
            self.encode[rows] = Graphed(functools.partial(mimi.encode, state=enc), [pcm],
                                        [enc], pool=pool)
            self.decode[rows] = Graphed(functools.partial(mimi.decode, state=dec), [codes],
                                        [dec], pool=pool)


def graphed_or_eager(build: Callable[[bool], T], device: torch.device,
                     graphs: bool | None = None) -> tuple[T, str | None]:
    """`build(graphs)`, with graphs as asked (None: wherever they can be captured). When a
    capture fails and graphs were not asked for, the engine is built eager instead ->
    (the engine, why it runs without graphs or None). Asked for, the CaptureError stands."""
    if not use_graphs(device, graphs):
        return build(False), None
    try:
        return build(True), None
    except CaptureError as error:
        if graphs:
            raise
        why = f"CUDA graphs could not be captured ({error}); running without them"
    gc.collect()  # the half-built engine's memory, before the eager one's comes
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return build(False), why
