"""A 30-minute `talk` session, unpaced: per-frame cost and memory stay flat as the window slides.

The golden tiny checkpoints (tests/data/golden/assets: a 64-frame LM context, so the
attention window has slid ~350 times by the end) run 22500 frames (30 minutes of audio)
through the same engine `talk` runs: `LiveLoop` with a `RecordingCaller` (a speech-like
caller, generated as it goes, no pacing), the assistant written to a float32 WAV as it
comes and the session recorded in stereo (`IncrementalWav`, header patched every second),
as `talk --input --output --record` does, minus the clock; this thread takes the text
pieces as talk's main thread does. Prints, per minute of audio, the
conversation step's p50/p99, the engine's whole per-frame loop time and the process RSS,
then the first minute against the last.

Run: python bench/talk_session.py [--minutes 30] [--threads 1] [--keep DIR]
Not a timed test: it takes about 22500 x (step time) of wall time (~8 min on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from live_signals import voice  # noqa: E402

from personaplex_cli.prompts.persona import Persona, prepare_persona  # noqa: E402
from personaplex_cli.runtime.rows import SourceRow  # noqa: E402
from personaplex_cli.runtime.scheduler import Scheduler  # noqa: E402
from personaplex_cli.core.sampling import Sampling  # noqa: E402
from personaplex_cli.core.config import FRAME_SIZE  # noqa: E402
from personaplex_cli.live.loop import FreeClock, LiveLoop, RecordingCaller  # noqa: E402
from personaplex_cli.live.record import IncrementalWav  # noqa: E402
from personaplex_cli.model.files import ModelDir  # noqa: E402
from personaplex_cli.model.model import Model  # noqa: E402
from personaplex_cli.prompts.voices import Voice  # noqa: E402

ASSETS = ROOT / "tests" / "data" / "golden" / "assets"
FRAMES_PER_MINUTE = 750  # 60 s / 80 ms


def tiny_model(folder: Path) -> Model:
    for name in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                 "tokenizer_spm_tiny_512.model", "personaplex-arch.json"):
        (folder / name).symlink_to(ASSETS / name)
    return Model(ModelDir(folder, "golden"), torch.device("cpu"), torch.float32)


def caller_frames(count: int):
    """A speech-like caller: a 20 s clip with pauses, looped, one frame at a time (a
    30-minute array would be 170 MB of the RSS being measured)."""
    clip = voice(20.0, 150, 3.5, seed=9, peak=0.4)
    clip_frames = len(clip) // FRAME_SIZE
    for k in range(count):
        i = k % clip_frames
        yield clip[i * FRAME_SIZE:(i + 1) * FRAME_SIZE]


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Timed:
    """The scheduler's step, timed; a row per minute of audio."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler_step = scheduler.step
        self.steps: list[float] = []
        self.loop_started = time.perf_counter()
        self.rows: list[tuple] = []

    def step(self, pcm: np.ndarray):
        began = time.perf_counter()
        frame = self.scheduler_step(pcm)
        self.steps.append(1000 * (time.perf_counter() - began))
        if len(self.steps) == FRAMES_PER_MINUTE:
            now = time.perf_counter()
            ms = sorted(self.steps)
            row = (len(self.rows) + 1, statistics.median(ms), ms[int(0.99 * len(ms))],
                   1000 * (now - self.loop_started) / len(ms), rss_mb())
            self.rows.append(row)
            print(f"{row[0]:6d}  {row[1]:8.2f}  {row[2]:8.2f}  {row[3]:9.2f}  {row[4]:8.1f}",
                  flush=True)
            self.steps, self.loop_started = [], now
        return frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="write the WAVs here instead of a temp dir")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    frames = args.minutes * FRAMES_PER_MINUTE
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        out_dir = args.keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        model = tiny_model(folder)
        voice_pt = Voice("NATF2", ASSETS / "voice_prompt_fp32.pt", "file")
        prompt = prepare_persona(model, Persona(voice_pt))
        scheduler = Scheduler.for_model(model, 1)
        timed = Timed(scheduler)
        scheduler.step = timed.step
        print(f"{frames} frames ({args.minutes} min of audio), LM context {model.lm.context} "
              f"frames, {args.threads} thread(s); RSS at start {rss_mb():.1f} MB")
        print(f"{'minute':>6}  {'step p50':>8}  {'step p99':>8}  {'loop mean':>9}  {'RSS MB':>8}")
        with open(out_dir / "assistant.wav", "wb") as a, open(out_dir / "session.wav", "wb") as r:
            output, record = IncrementalWav(a, 1), IncrementalWav(r, 2)
            engine = LiveLoop(scheduler, SourceRow(prompt, Sampling(), 0),
                              RecordingCaller(caller_frames(frames), FreeClock()), output,
                              record=record.write_stereo)
            began = time.monotonic()
            engine.start()
            pieces = 0
            while not engine.wait(0.05):  # talk's main thread: take the text as it comes
                while engine.pieces:
                    engine.pieces.popleft()
                    pieces += 1
            if engine.error is not None:
                raise engine.error
            output.close()
            record.close()
        took = time.monotonic() - began
        print(f"{engine.frames} frames in {took:.0f} s ({1000 * took / engine.frames:.1f} ms "
              f"per frame, real-time factor {took / (engine.frames * 0.08):.2f}); "
              f"recording {record.seconds / 60:.1f} min")
        first, last = timed.rows[0], timed.rows[-1]
        print(f"first minute: step p50 {first[1]:.2f} ms, p99 {first[2]:.2f} ms, loop "
              f"{first[3]:.2f} ms, RSS {first[4]:.1f} MB")
        print(f"last minute:  step p50 {last[1]:.2f} ms, p99 {last[2]:.2f} ms, loop "
              f"{last[3]:.2f} ms, RSS {last[4]:.1f} MB")
        print(f"last vs first: step p50 {last[1] / first[1]:.2f}x, RSS "
              f"{last[4] - first[4]:+.1f} MB")


if __name__ == "__main__":
    main()
