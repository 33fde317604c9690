"""How much memory a run needs, and whether the device has it: the one home of that arithmetic.

    need = LM weights + (streams + primer rows) x (KV per stream + graphs per row) + Mimi
           + margin

LM weights  the tensors `load_lm` allocates, counted on a model built on the meta device (no
            memory, exact shapes): the compute dtype's bytes, int8 or fp8 bytes plus one
            scale per row for the quantized linears; only the depformer steps that run;
KV          the temporal transformer's ring (layers x keys and values x (context + 1) slots x
            dim) and the depformer's, in the compute dtype whatever the quantization, plus
            Mimi's encoder and decoder rings (fp32), per stream, and as many more as the
            runtime's primer has rows, the side batch that primes newcomers (runtime/priming.py,
            core.config.primer_rows: up to PRIMER_ROWS, never more than the streams, and none
            for one stream, whose row primes in place; the primed personas it keeps stay in
            host memory);
graphs      with CUDA graphs (core/graphs.py), what they hold beside the rows' own
            tensors, per row (`graph_bytes_per_row`): their share of the one memory pool
            (whose peak is the widest captured step's temporaries), the static inputs and
            outputs each live count's graphs keep, and the noise buffers at the graphs'
            fixed widths. A capture itself copies nothing (it runs on rows that hold no
            stream yet), so it adds no transient beyond the pool's own peak;
Mimi        its weights, fp32;
margin      what the process needs beyond these tensors: on CUDA the context, cuBLAS
            workspaces and eager activations; on the CPU the torch runtime and the
            activations, measured at the real size (docs/memory.md).
Used by doctor, by reply and talk before they load anything, and by a server sizing its
sessions (`sessions_that_fit`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..core.config import Arch, Quantize, primer_rows
from ..core.layers import attends_by_bags, ring_capacity, stored_key_slots
from ..core.lm import LMModel
from ..core.mimi import STEPS_PER_FRAME, Mimi
from ..core.quantize import Int8RowsLinear, replace_linears
from ..errors import DeviceError
from .device import DTYPES, quantize_problem
from .skeleton import shapes_only

GIB = 1024 ** 3
# Not measured yet on a GPU (none was lent to this project so far): the CUDA context (~0.5
# GiB), cuBLAS workspaces and eager activations, with allocator slack (the graphs' memory
# is counted on its own: graph_bytes_per_row).
# bench/gpu_frame.py prints the measured figure.
CUDA_MARGIN = 2 * GIB
# Measured with bench/full_size.py's 7B on the CPU: peak RSS less the tensors' bytes.
CPU_MARGIN = 1 * GIB


def gib(n: float) -> str:
    """A size for a line: GiB, or MiB below a tenth of one (a small model's "0.0 GiB" of
    weights would say nothing)."""
    if abs(n) < GIB / 10:
        return f"{n / 1024 ** 2:.1f} MiB"
    return f"{n / GIB:.1f} GiB"


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and persistent buffers (what loading it allocates);
    a layer whose weight a kernel holds packed (core.quantize.Int8Linear) counts its
    `stored_bytes()`, without unpacking a copy."""
    total = 0
    for child in module.modules():
        stored = getattr(child, "stored_bytes", None)
        if stored is not None:
            total += stored()
            continue
        tensors = [*child._parameters.values(),
                   *(b for name, b in child._buffers.items()
                     if name not in child._non_persistent_buffers_set)]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


@dataclass(frozen=True)
class MemoryNeed:
    weights: int  # the LM's, as loaded
    kv_per_stream: int  # the LM's and Mimi's rings, one stream
    streams: int
    mimi: int  # Mimi's weights
    margin: int
    graph_per_row: int = 0  # with CUDA graphs (graph_bytes_per_row), else 0

    @property
    def total(self) -> int:
        return (self.weights + (self.streams + self.primer) * self.kv_per_stream + self.mimi
                + self.margin + self.graphs)

    @property
    def graphs(self) -> int:
        """What the CUDA graphs of these streams and their primer hold (0 without)."""
        return (self.streams + self.primer) * self.graph_per_row

    @property
    def primer(self) -> int:
        """The primer's rows beside these streams (runtime/priming.py)."""
        return primer_rows(self.streams)

    def __str__(self) -> str:
        windows = f"{self.streams} + {self.primer}" if self.primer else f"{self.streams}"
        graphs = f" + {gib(self.graphs)} graphs" if self.graphs else ""
        return (f"{gib(self.weights)} weights + {windows} x {gib(self.kv_per_stream)} KV"
                f"{graphs} + {gib(self.mimi)} Mimi + {gib(self.margin)} margin")


def lm_weight_bytes(lm_arch: dict, dep_steps: int, dtype: torch.dtype,
                    quantize: Quantize, device: torch.device | None = None) -> int:
    """The LM's weights as loaded on `device`: int8 on a CPU whose own int8 kernel runs
    (model/native.py) holds that kernel's layout, padded, with its row sums and scales; the
    bf16 linears it keeps in its tiles (core.quantize.tile_bf16_linears), padded to whole
    tiles."""
    from .native import native_bf16_for, native_kernel_for

    with shapes_only():
        lm = LMModel(lm_arch, dep_steps, dtype).to(dtype)
        replace_linears(lm, quantize, dtype)
    total = tensor_bytes(lm)
    native = device is not None and native_kernel_for(device, quantize)
    if native:
        total += sum(native.stored_bytes(m.out_features, m.in_features)
                     - m.out_features * m.in_features
                     for m in lm.modules() if isinstance(m, Int8RowsLinear))
    tiled = device is not None and native_bf16_for(device, quantize, dtype)
    if tiled:
        total += sum(tiled.stored_bytes(m.out_features, m.in_features) - tensor_bytes(m)
                     for m in lm.modules() if type(m) is nn.Linear and tiled.takes(m.weight))
    return total


def kv_bytes_per_stream(lm_arch: dict, mimi_transformer: dict, dtype: torch.dtype,
                        device_type: str = "cpu", quantize: Quantize = "none") -> int:
    """The KV rings of one stream: the LM's at `dtype`, Mimi's encoder and decoder in fp32
    (one frame per call; their conv histories add a few kB). A quantized LM on the CPU
    keeps its long windows' keys by blocks, the last one padded (core.layers.BlockKVRing)."""
    itemsize = torch.empty((), dtype=dtype).element_size()

    def ring(layers: int, context: int, dim: int) -> int:
        capacity = ring_capacity(context, 1)
        blocks = attends_by_bags(quantize == "none", device_type, capacity)
        return layers * (stored_key_slots(capacity, blocks) + capacity) * dim

    temporal = ring(lm_arch["num_layers"], lm_arch["context"], lm_arch["dim"])
    depformer = ring(lm_arch["depformer_num_layers"], lm_arch["dep_q"],
                     lm_arch["depformer_dim"])
    mimi = (2 * mimi_transformer["num_layers"] * 2
            * ring_capacity(mimi_transformer["context"], STEPS_PER_FRAME)
            * mimi_transformer["d_model"])
    return (temporal + depformer) * itemsize + mimi * 4


# Bytes a noise candidate takes in a sampling row (core/sampling.RowSampling): the noise
# (fp32), the keyed noise made into it (fp32) and the hash's two int64 work buffers.
NOISE_BYTES = 4 + 4 + 8 + 8


def graph_bytes_per_row(arch: Arch, lm_arch: dict, dep_steps: int, dtype: torch.dtype) -> int:
    """What CUDA graphs hold per row of a batch (the same for a primer row, which needs
    less): a share of the pool, the inputs and outputs the graphs keep, and the noise
    buffers at the graphs' widths. Checked against a mocked capture at the 7B's size and an
    H200's 64 rows (tests/test_graphs.py), not yet on a GPU.

    pool     its peak is the widest step's temporaries, Mimi's encoder on one frame: the first
             SEANet stage's input, activation and history (3 x filters x frame) and its
             residual convolution's unfolded patches (kernel x filters x frame), fp32; the
             text sampling's (four fp32 copies of the text logits) where that is wider;
    kept     each live count's graphs (1, 2, 4 ... rows: fewer than twice the batch's rows
             in all) keep their static inputs and outputs: the LM step's input, context and
             text logits in the compute dtype, the frame's tokens, and Mimi's audio in and
             out, fp32;
    noise    text and every depformer step's audio noise at the graphs' widths, whatever
             the rows' top-k (core.graphs.GRAPH_NOISE_WIDTHS).
    """
    from ..core.graphs import GRAPH_NOISE_WIDTHS

    itemsize = torch.empty((), dtype=dtype).element_size()
    seanet = arch.mimi.seanet
    frame = Mimi.frame_size  # samples
    mimi_step = (3 + seanet["residual_kernel_size"]) * seanet["n_filters"] * frame * 4
    sampling_step = 4 * lm_arch["text_card"] * 4
    tokens = lm_arch["n_q"] + 1
    kept = 2 * ((2 * lm_arch["dim"] + lm_arch["text_card"]) * itemsize + 3 * tokens * 8
                + 2 * frame * 4)
    text_width, audio_width = (min(width, vocab) for width, vocab in
                               zip(GRAPH_NOISE_WIDTHS, (lm_arch["text_card"], lm_arch["card"])))
    noise = (text_width + dep_steps * audio_width) * NOISE_BYTES
    return max(mimi_step, sampling_step) + kept + noise


def mimi_weight_bytes(arch: Arch) -> int:
    with shapes_only():
        return tensor_bytes(Mimi(arch.mimi))


def memory_need(arch: Arch, lm_arch: dict, dep_steps: int, device: torch.device,
                dtype: torch.dtype, quantize: Quantize, streams: int = 1,
                graphs: bool | None = None) -> MemoryNeed:
    """What a run of `streams` streams needs on `device` (the LM at `dtype`, quantized),
    with CUDA graphs as `graphs` says (None: on CUDA, as the engine takes them by default)."""
    graphs = device.type == "cuda" if graphs is None else graphs
    return MemoryNeed(weights=lm_weight_bytes(lm_arch, dep_steps, dtype, quantize, device),
                      kv_per_stream=kv_bytes_per_stream(lm_arch, arch.mimi.transformer, dtype,
                                                        device.type, quantize),
                      streams=streams, mimi=mimi_weight_bytes(arch),
                      margin=CUDA_MARGIN if device.type == "cuda" else CPU_MARGIN,
                      graph_per_row=(graph_bytes_per_row(arch, lm_arch, dep_steps, dtype)
                                     if graphs else 0))


def default_dep_steps(lm_arch: dict) -> int:
    """The depformer steps built unless asked otherwise: the assistant's codebooks only."""
    return min(lm_arch["dep_q"], lm_arch["n_q"] // 2)


def personaplex_need(dtype: str = "bf16", quantize: Quantize = "none", streams: int = 1,
                     device_type: str = "cuda", arch: Arch | None = None) -> MemoryNeed:
    """The need of the published PersonaPlex model (its default architecture, 8 depformer
    steps loaded), or of `arch`, for doctor: by names, so the caller needs no torch of its
    own."""
    arch = Arch() if arch is None else arch
    return memory_need(arch, arch.lm, default_dep_steps(arch.lm), torch.device(device_type),
                       DTYPES[dtype], quantize, streams)


# -- what the process holds -------------------------------------------------------------------

def release_free_memory(gpu: bool = True) -> None:
    """Hands memory freed inside the process back to the system: glibc's heaps keep freed
    chunks below their top (a load's temporaries, between the tensors it keeps) counted in
    the RSS though nothing uses them, and (with `gpu`) CUDA's caching allocator keeps freed
    blocks reserved. Called after loading, so what the count leaves out is not held."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass  # not glibc: nothing of this kind to hand back
    if gpu and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- what the device has ---------------------------------------------------------------------

def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What a cgroup v2 memory limit (a container's) still leaves, or None without one."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_bytes(device: torch.device) -> int | None:
    """Memory a new run can have: free GPU memory, or the RAM the kernel says is available
    (within a container's limit). None where it cannot be told."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # a driver that cannot say: no check rather than a false alarm
            return None
    if device.type != "cpu":
        return None
    found = [n for n in (_meminfo_available(), _cgroup_room()) if n is not None]
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            pass
    return min(found) if found else None


def sessions_that_fit(need: MemoryNeed, available: int) -> int:
    """How many streams fit in `available` bytes beside the weights, Mimi and the margin."""
    room = available - (need.weights + need.mimi + need.margin)
    windows = room // (need.kv_per_stream + need.graph_per_row)  # the streams' and primer's
    return next((n for n in range(windows, 0, -1) if n + primer_rows(n) <= windows), 0)


# -- the check before loading ----------------------------------------------------------------

def _fix(arch: Arch, lm_arch: dict, dep_steps: int, device: torch.device, dtype: torch.dtype,
         quantize: Quantize, streams: int, have: int, streams_option: str | None,
         graphs: bool | None = None) -> str:
    """The smallest change of options that fits, as the words to type."""
    options = []
    int8_runs = quantize_problem(device, "int8") is None
    if quantize == "none" and int8_runs:
        options.append(({"quantize": "int8"}, "--quantize int8"))
    if dtype == torch.float32:
        options.append(({"dtype": torch.bfloat16}, "--dtype bf16"))
        if quantize == "none" and int8_runs:
            options.append(({"dtype": torch.bfloat16, "quantize": "int8"},
                             "--dtype bf16 --quantize int8"))
    if quantize != "int4" and quantize_problem(device, "int4", dtype) is None:
        options.append(({"quantize": "int4"}, "--quantize int4"))
    if (quantize != "int4" and dtype != torch.bfloat16
            and quantize_problem(device, "int4") is None):
        options.append(({"dtype": torch.bfloat16, "quantize": "int4"},
                         "--dtype bf16 --quantize int4"))
    for change, words in options:
        need = memory_need(arch, lm_arch, dep_steps, device, change.get("dtype", dtype),
                           change.get("quantize", quantize), streams, graphs)
        if need.total <= have:
            return f"use {words} (about {gib(need.total)})"
    if streams > 1 and streams_option:
        need = memory_need(arch, lm_arch, dep_steps, device, dtype, quantize, 1, graphs)
        fit = sessions_that_fit(need, have)
        if fit >= 1:
            return f"use {streams_option} {fit} (about {gib(replace(need, streams=fit).total)})"
    smallest_mode = "int4" if quantize_problem(device, "int4") is None else "int8"
    smallest = memory_need(arch, lm_arch, dep_steps, device, torch.bfloat16, smallest_mode, 1,
                           graphs)
    where = "a GPU" if device.type == "cuda" else "a machine"
    return (f"free memory, or use {where} with more (the smallest run, --dtype bf16 "
            f"--quantize {smallest_mode} with one stream, needs about {gib(smallest.total)})")


def check_fits(arch: Arch, lm_arch: dict, dep_steps: int, device: torch.device,
               dtype: torch.dtype, quantize: Quantize, streams: int = 1,
               streams_option: str | None = None,
               available: int | None = None, *, graphs: bool | None = None) -> MemoryNeed:
    """The run's need, or DeviceError (exit 5) with a one-line fix when `device` lacks it.
    `available` defaults to what the device has now; unknown means no check."""
    need = memory_need(arch, lm_arch, dep_steps, device, dtype, quantize, streams, graphs)
    have = available_bytes(device) if available is None else available
    if have is None or need.total <= have:
        return need
    what = "free" if device.type == "cuda" else "available"
    precision = str(dtype).removeprefix("torch.") + ("" if quantize == "none" else
                                                     f", {quantize} weights")
    fix = _fix(arch, lm_arch, dep_steps, device, dtype, quantize, streams, have,
               streams_option, graphs)
    raise DeviceError(f"the model needs about {gib(need.total)} on {device} ({precision}: "
                      f"{need}) but only {gib(have)} is {what}: {fix}")
