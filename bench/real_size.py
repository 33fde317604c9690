"""The 7B at its real size on this machine: load time, memory, ms per frame, full KV window.

Takes a model folder (bench/full_size.py writes a random-weight one) and runs what `reply`
runs per frame (Mimi encode, the LM step with its 8 depformer steps, Mimi decode), at batch
1, greedy. Prints:
  load     seconds to build the LM and Mimi from the files (the pre-load checks included);
  tensors  bytes of the loaded tensors, and the process's RSS right after loading;
  frames   median ms per frame with the KV window nearly empty, then with it full;
  rss      the RSS with the window full, and the process's peak RSS (VmHWM).
"Full" is the 3000-frame window as it stands after 240 s of conversation: every ring slot
marked as holding a past position, so each step attends over all 3000 (it does not take
3000 real frames, hours on a CPU). The KV ring is allocated whole when the conversation
starts, so its memory is the same empty or full; what could grow is the rest.

Run: python bench/real_size.py DIR [--dtype bf16|fp32] [--quantize none|int8|int4] [--frames N]
Run it alone, under `nice`, with memory well above the need (`free -g`).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

import torch

from personaplex_cli.core.sampling import Sampling
from personaplex_cli.doctor.bench import BenchModel
from personaplex_cli.prompts.persona import PersonaPrompt
from personaplex_cli.runtime.scheduler import Scheduler
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.memory import GIB, tensor_bytes
from personaplex_cli.model.model import Model, resolve_dtype


def status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def fill_window(gen) -> None:
    """Makes a FrameGenerator's temporal KV ring look full: every slot holds a past
    position, as after 240 s of conversation."""
    window = gen.temporal[gen.lm.transformer]
    end = window.capacity + 100
    window.offset.fill_(end)  # a row's fill is its offset (core/layers.py WindowState)
    positions = torch.arange(end - window.capacity, end)
    window.slot_pos[:, positions % window.capacity] = positions


def median_ms(slots: Scheduler, audio: torch.Tensor) -> tuple[float, float]:
    """-> median wall ms per frame, and this process's CPU seconds per frame (which a busy
    machine does not inflate: compare it with the wall time over the threads)."""
    times = []
    cpu = time.process_time()
    for frame in audio:
        start = time.perf_counter()
        slots.step(frame[None].numpy())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:]), (time.process_time() - cpu) / len(audio)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--quantize", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--frames", type=int, default=12)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    started = time.monotonic()
    model = Model(ModelDir(args.folder, str(args.folder)), device,
                  resolve_dtype(args.dtype, device), quantize=args.quantize)
    need = model.preflight()
    lm, mimi = model.lm, model.mimi
    load_s = time.monotonic() - started
    loaded = tensor_bytes(lm) + tensor_bytes(mimi)
    rss_loaded = status_kib("VmRSS") * 1024
    print(f"{args.folder}: LM {str(model.dtype).removeprefix('torch.')}, quantize "
          f"{args.quantize}, {args.threads} threads, torch {torch.__version__}")
    print(f"need     {need.total / GIB:.2f} GiB by model/memory.py ({need})")
    print(f"load     {load_s:.1f} s")
    print(f"tensors  {loaded / GIB:.2f} GiB; RSS after loading {rss_loaded / GIB:.2f} GiB")
    slots = Scheduler.for_model(BenchModel(mimi, lm), 1, graphs=False)
    # the shortest persona (14 frames of priming): two text tokens
    slots.join(PersonaPrompt([10, 11]), Sampling(greedy=True), 0)
    audio = 0.1 * torch.randn(args.frames, 1920)
    empty = median_ms(slots, audio)
    fill_window(slots.session.gen)
    full = median_ms(slots, audio)
    rss_full = status_kib("VmRSS") * 1024
    peak = status_kib("VmHWM") * 1024
    print(f"frames   {empty[0]:.0f} ms/frame with the window nearly empty, {full[0]:.0f} "
          f"ms/frame with it full (median of {args.frames}); CPU time {empty[1]:.1f} and "
          f"{full[1]:.1f} s/frame; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    print(f"rss      {rss_full / GIB:.2f} GiB with the window full; peak {peak / GIB:.2f} GiB; "
          f"beyond the tensors and the KV: {(peak - loaded - need.kv_per_stream) / GIB:.2f} GiB")


if __name__ == "__main__":
    main()
