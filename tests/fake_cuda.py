"""torch.cuda mocked on the CPU: devices, streams, graph capture and memory, for checks that
need a GPU's size rather than its speed.

The model's tensors live on the meta device (shapes and dtypes, no storage: a 7B and 64 rows
of KV rings cost nothing here), which stands for the GPU the model is on (`model_device`,
cuda:1 by default: not the current one, as with `--device cuda:1`). The mock
- keeps a current device, cuda:0 at first; `torch.cuda.device(d)` switches it for a block;
- makes streams on a device (the current one unless named), and records each capture (the
  device current when it began and the device of the stream it captured on) and each
  replay (the device current then);
- counts memory: every storage made while `counting` is on is held until it is freed (a
  weak reference to it), so `live()` is what the process holds now of what it made; each
  graph made (core.graphs.Graphed, its warm-up and capture together) and each capture
  record the most held at once above what was held when they began (`transient`), and
  what was still held when they ended (`kept`).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from personaplex_cli.core import graphs

GIB = 1024 ** 3


@dataclass
class Held:
    transient: int = 0  # the most bytes held at once during it, above its start
    kept: int = 0  # bytes still held at its end, above its start


@dataclass
class Capture(Held):
    current: torch.device | None = None  # the current device when the capture began
    stream: torch.device | None = None  # the device of the stream it captured on


class _Stream:
    def __init__(self, device: torch.device):
        self.device = device

    def wait_stream(self, other: "_Stream") -> None:
        pass


class _Counter(TorchFunctionMode):
    """Registers the storage of every tensor an operation returns that is not known yet."""

    def __init__(self, cuda: "FakeCuda"):
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(tensor, torch.Tensor):
                self.cuda.register(tensor)
        self.cuda.sample()
        return out


@dataclass
class FakeCuda:
    model_device: torch.device = torch.device("cuda:1")
    free_bytes: int = 139 * GIB  # an H200's, as the device machine reports it
    current: torch.device = torch.device("cuda:0")
    captures: list[Capture] = field(default_factory=list)
    graphs_made: list[Held] = field(default_factory=list)
    replays: list[torch.device] = field(default_factory=list)  # the current device at each
    _known: set = field(default_factory=set)
    _storages: dict = field(default_factory=dict)  # cdata -> (weak ref, bytes)
    _young: dict = field(default_factory=dict)  # the same, made since the last full look
    _held_before: int = 0
    _watching: list[list[int]] = field(default_factory=list)  # [start, peak] of open windows

    def _real(self, device) -> torch.device:
        device = torch.device(device) if device is not None else self.current
        if device.type == "meta":
            return self.model_device
        return torch.device("cuda", self.current.index if device.index is None else device.index)

    # -- memory ---------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._known or key in self._storages or key in self._young:
            return
        self._young[key] = (StorageWeakRef(storage), storage.nbytes())

    def live(self) -> int:
        """Bytes held now of what was made while counting (every storage looked at)."""
        self._storages.update(self._young)
        self._young.clear()
        self._storages = {key: entry for key, entry in self._storages.items()
                          if not entry[0].expired()}
        return sum(size for _, size in self._storages.values())

    def sample(self) -> None:
        """The open windows' peaks, from what was made since the innermost began (what was
        there before is taken as still held: a peak a little high, never low)."""
        if self._watching:
            self._young = {key: entry for key, entry in self._young.items()
                           if not entry[0].expired()}
            now = self._held_before + sum(size for _, size in self._young.values())
            for window in self._watching:
                window[1] = max(window[1], now)

    @contextlib.contextmanager
    def counting(self):
        """Counts what is made inside (what exists before is known, and never counted)."""
        gc.collect()
        with warnings.catch_warnings():  # a deprecated torch object warns when looked at
            warnings.simplefilter("ignore")
            self._known = {o.untyped_storage()._cdata for o in gc.get_objects()
                           if isinstance(o, torch.Tensor)}
        with _Counter(self):
            yield

    @contextlib.contextmanager
    def _window(self, capture: Held):
        start = self._held_before = self.live()
        window = [start, start]
        self._watching.append(window)
        try:
            yield
        finally:
            self._watching.remove(window)
            capture.transient = window[1] - start
            capture.kept = self.live() - start
            self._held_before = self.live()

    # -- torch.cuda ------------------------------------------------------------------------------

    def install(self, monkeypatch) -> "FakeCuda":
        cuda = self
        default_stream: dict = {}

        @contextlib.contextmanager
        def device(d):
            before, cuda.current = cuda.current, cuda._real(d)
            try:
                yield
            finally:
                cuda.current = before

        def current_stream(d=None):
            return _Stream(cuda._real(d))

        class Graph:
            def __init__(self):
                self.captured = False

            def replay(self):
                assert self.captured
                cuda.replays.append(cuda.current)

            def pool(self):
                return object()

        class graph:  # noqa: N801 (torch's name)
            def __init__(self, cuda_graph, pool=None, stream=None, **_):
                if stream is None:  # torch's default: made once, on the device current then
                    stream = default_stream.setdefault("stream", _Stream(cuda.current))
                self.cuda_graph = cuda_graph
                self.capture = Capture(current=cuda.current, stream=stream.device)

            def __enter__(self):
                cuda.captures.append(self.capture)
                self._window = cuda._window(self.capture)
                self._window.__enter__()

            def __exit__(self, *exc):
                self._window.__exit__(*exc)
                self.cuda_graph.captured = exc[0] is None

        for name, value in {
            "is_available": lambda: True, "device_count": lambda: 2,
            "current_device": lambda: cuda.current.index, "device": device,
            "Stream": lambda d=None, **_: _Stream(cuda._real(d)),
            "current_stream": current_stream,
            "stream": lambda s: contextlib.nullcontext(),
            "CUDAGraph": Graph, "graph": graph, "graph_pool_handle": lambda: object(),
            "synchronize": lambda d=None: None, "empty_cache": lambda: None,
            "mem_get_info": lambda d=None: (cuda.free_bytes, cuda.free_bytes + GIB),
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        # The meta device plays the model's GPU: graphs are captured there.
        monkeypatch.setattr(graphs.Graphed, "devices", ("cuda", "meta"))
        monkeypatch.setattr(graphs, "_CAPTURE_STREAMS", {})
        make = graphs.Graphed.__init__

        def made(graph, *args, **kwargs):
            held = Held()
            cuda.graphs_made.append(held)
            with cuda._window(held):
                make(graph, *args, **kwargs)

        monkeypatch.setattr(graphs.Graphed, "__init__", made)
        return self
