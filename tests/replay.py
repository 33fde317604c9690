"""A CPU stand-in for core.graphs.Graphed: CUDA graph replay, emulated where no GPU is.

A capture records a step's kernels once; a replay runs them again and no Python at all.
`ReplayDouble` runs the captured function at every call instead, and fails wherever that
would not be what a replay does:
- host-side state the step changes (a numpy counter, a Python attribute) would move once,
  at capture, and never again on a replay: any change is an error;
- a host sync (a tensor's value read on the host: item(), int(), bool(), nonzero) cannot be
  captured: an error;
- a replay runs the recorded kernels: the step must run the same operations on the same
  shapes at every call (a Python branch taken another way would not be replayed): an error.
Its outputs are copied into the capture's own output tensors, as a replay overwrites its
buffers. Everything else is the real Graphed's: the inputs copied into static buffers, the
rows started afresh around the capture; nothing is undone that the real one does not undo.

`emulate_graphs(monkeypatch)` puts it in place of core.graphs.Graphed, so graphs=True works
on the CPU.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from personaplex_cli.core import graphs

# What reads a device value back to the host, or sizes a result by one: a graph cannot.
HOST_SYNCS = {"item", "tolist", "numpy", "cpu", "nonzero", "masked_select", "__bool__",
              "__int__", "__float__", "__index__"}


class HostSync(AssertionError):
    pass


class HostStateChanged(AssertionError):
    pass


class NotReplayable(AssertionError):
    pass


class _Recorder(TorchFunctionMode):
    """Records (operation, output shapes and dtypes) and refuses host syncs."""

    def __init__(self):
        super().__init__()
        self.trace: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_SYNCS:
            raise HostSync(f"{name} reads a device value on the host: a graph cannot hold it")
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        self.trace.append((name, tuple((tuple(t.shape), t.dtype) for t in flat
                                       if isinstance(t, torch.Tensor))))
        return out


def host_state(root, path: str = "", seen: set | None = None, depth: int = 0) -> dict:
    """Every host-side value reachable from `root` (numpy arrays and Python scalars, through
    objects' attributes, containers, partials, bound methods and closures) by its path;
    tensors, modules and generators are device state and are not entered."""
    seen = set() if seen is None else seen
    found: dict = {}
    if depth > 8 or id(root) in seen:
        return found
    if isinstance(root, np.ndarray):
        return {path: (root.shape, root.tobytes())}
    if root is None or isinstance(root, (bool, int, float, str, bytes)):
        return {path: root}
    if isinstance(root, (torch.Tensor, torch.nn.Module, torch.Generator, graphs.Graphed,
                         type, torch.dtype, torch.device)):
        return found
    seen.add(id(root))
    if isinstance(root, functools.partial):
        items = [("func", root.func), ("args", root.args), ("keywords", root.keywords)]
    elif hasattr(root, "__self__") and hasattr(root, "__func__"):  # a bound method
        items = [("self", root.__self__)]
    elif callable(root) and hasattr(root, "__closure__"):
        items = [(f"cell{i}", cell.cell_contents) for i, cell in
                 enumerate(root.__closure__ or ())]
    elif isinstance(root, dict):
        items = [(f"[{i}]", value) for i, value in enumerate(root.values())]
    elif isinstance(root, (list, tuple)):
        items = [(f"[{i}]", value) for i, value in enumerate(root)]
    elif hasattr(root, "__dict__"):
        items = list(vars(root).items())
    else:
        return found
    found[path + ":len"] = len(items)
    for name, value in items:
        found.update(host_state(value, f"{path}.{name}", seen, depth + 1))
    return found


def _tensors(outputs) -> list[torch.Tensor]:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


class ReplayDouble(graphs.Graphed):
    devices = ("cpu", "cuda")
    captures = 0  # how many graphs were captured (counted on the class)
    replays = 0

    @staticmethod
    def on_device(device):
        return contextlib.nullcontext()

    @classmethod
    def new_pool(cls, device):
        return None

    def _run(self) -> tuple[object, list[tuple]]:
        before = host_state([self._fn, self._states])
        recorder = _Recorder()
        with recorder, torch.inference_mode():
            outputs = self._fn(*self.inputs)
        after = host_state([self._fn, self._states])
        changed = sorted(set(before.items()) ^ set(after.items()), key=str)
        if changed:
            raise HostStateChanged(f"the captured step changed host-side state, which a "
                                   f"replay would leave as it was: {changed[0][0]}")
        return outputs, recorder.trace

    def _capture(self, fn, pool, warmup):
        self._fn = fn
        traces = []
        for _ in range(warmup + 1):
            outputs, trace = self._run()
            traces.append(trace)
        if any(trace != traces[0] for trace in traces):
            raise NotReplayable("the step ran different operations from one call to the next")
        self._trace = traces[0]
        type(self).captures += 1
        return outputs

    def _replay(self) -> None:
        outputs, trace = self._run()
        if trace != self._trace:
            first = next((i for i, (a, b) in enumerate(zip(trace, self._trace)) if a != b),
                         min(len(trace), len(self._trace)))
            raise NotReplayable(f"a replay would run the captured operations, but this call "
                                f"ran others from operation {first}")
        for buffer, value in zip(_tensors(self.outputs), _tensors(outputs), strict=True):
            buffer.copy_(value)
        type(self).replays += 1


def emulate_graphs(monkeypatch) -> None:
    """CUDA graphs on the CPU, through ReplayDouble, for the rest of the test."""
    monkeypatch.setattr(graphs, "Graphed", ReplayDouble)
