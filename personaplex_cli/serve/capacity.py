"""How many conversations fit the device: the default of `serve --max-sessions`.

A simple estimate for now, from the loaded model's own shapes: each conversation holds the
temporal KV window (layers x keys and values x context frames x model width, at the LM's
dtype) plus a margin for Mimi's streaming state and the per-row buffers; what is free on the
device after loading, less a reserve, is divided by that. The arithmetic of `doctor`
(diagnose.py) is the one to connect here once it counts per-stream memory for serving.
"""

from __future__ import annotations

GIB = 1024 ** 3
RESERVE_BYTES = 1 * GIB  # kept free: CUDA graphs, activations, allocator slack
ROW_OVERHEAD_BYTES = 64 * 1024 ** 2  # per conversation beyond its KV: Mimi state, buffers
MOST_SESSIONS = 64  # never more by default: the warm-up line says how many keep real time


def kv_bytes_per_session(lm) -> int:
    dim = lm.out_norm.alpha.shape[-1]
    element = next(lm.parameters()).element_size()
    return len(lm.transformer.layers) * 2 * lm.context * dim * element


def free_device_bytes(device) -> int:
    """Free memory where the model runs: the GPU's free memory, or the host's available."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sessions_that_fit(model) -> int:
    """Conversations the device's free memory holds (at least 1, at most MOST_SESSIONS)."""
    per_session = kv_bytes_per_session(model.lm) + ROW_OVERHEAD_BYTES
    room = free_device_bytes(model.device) - RESERVE_BYTES
    return max(1, min(MOST_SESSIONS, room // per_session))
