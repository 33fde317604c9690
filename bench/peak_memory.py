"""Where a run's memory goes, phase by phase, against model/memory.py's count.

Follows what `reply` does with one caller: the pre-load check, the LM, Mimi, the engine's
slots (a conversation's KV window and the primer's), priming a short persona, a few frames.
After each phase it prints the process's RSS, its peak so far (VmHWM), and glibc's own
figures: bytes handed out from its heaps, bytes free in them (held by the process, counted
in its RSS, used by nothing), and bytes in mapped chunks.

With --size mid (or tiny, full) instead of DIR: random weights at those dimensions, built
through the same loader (doctor --bench's), so the phases after loading can be looked at in
minutes.

Run: python bench/peak_memory.py DIR [--dtype bf16] [--quantize none|int8|int4] [--frames N]
     python bench/peak_memory.py --size mid [--quantize ...]
Run it alone, with memory well above the count (`free -g`).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import time
from pathlib import Path

import torch

from personaplex_cli.core.sampling import Sampling
from personaplex_cli.doctor.bench import BenchModel
from personaplex_cli.prompts.persona import PersonaPrompt
from personaplex_cli.runtime.scheduler import Scheduler
from personaplex_cli.model.files import ModelDir
from personaplex_cli.doctor.bench import bench_arch, random_mimi, random_source
from personaplex_cli.model.load import build_lm, default_dep_steps
from personaplex_cli.model.memory import GIB, memory_need, tensor_bytes
from personaplex_cli.model.model import Model, resolve_dtype


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def status_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def report(phase: str, started: float) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    print(f"{phase:<12} {time.monotonic() - started:7.1f} s  RSS {status_bytes('VmRSS') / GIB:6.2f}"
          f"  peak {status_bytes('VmHWM') / GIB:6.2f} GiB  malloc heaps: in use "
          f"{info.uordblks / GIB:5.2f}, free {info.fordblks / GIB:5.2f}, mapped "
          f"{info.hblkhd / GIB:5.2f} GiB", flush=True)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?")
    parser.add_argument("--size", choices=("tiny", "mid", "full"))
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp32"))
    parser.add_argument("--quantize", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--frames", type=int, default=3)
    args = parser.parse_args()
    started = time.monotonic()
    device = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    if args.folder is not None:
        model = Model(ModelDir(args.folder, str(args.folder)), device, dtype,
                      quantize=args.quantize)
        need = model.preflight()
    else:
        arch = bench_arch(args.size or "mid")
        steps = default_dep_steps(arch.lm)
        need = memory_need(arch, arch.lm, steps, device, dtype, args.quantize)
    print(f"count    {need.total / GIB:.2f} GiB ({need})")
    report("checked", started)
    if args.folder is not None:
        lm = model.lm
    else:
        lm = build_lm(arch.lm, steps, device, dtype, args.quantize,
                      random_source(arch.lm, device, dtype, 0))
    report("LM loaded", started)
    mimi = model.mimi if args.folder is not None else random_mimi(arch, device, 0)
    report("Mimi loaded", started)
    print(f"tensors  LM {tensor_bytes(lm) / GIB:.2f} GiB, Mimi {tensor_bytes(mimi) / GIB:.2f} GiB")
    slots = Scheduler.for_model(BenchModel(mimi, lm), 1, graphs=False)
    report("slots", started)
    slots.join(PersonaPrompt([10, 11]), Sampling(greedy=True), 0)
    report("primed", started)
    for frame in 0.1 * torch.randn(args.frames, 1920):
        slots.step(frame[None].numpy())
    report("frames", started)
    peak = status_bytes("VmHWM")
    print(f"peak     {peak / GIB:.2f} GiB against the count {need.total / GIB:.2f} GiB: "
          f"{peak / need.total:.3f}")


if __name__ == "__main__":
    main()
