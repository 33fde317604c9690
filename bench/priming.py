"""Priming beside talking rows, paced as serve's engine paces it (a step every 80 ms tick,
priming steps in what the tick leaves, at the measured cost of a primer step), on the small
random model of bench/reply.py:

1. A cached-persona newcomer's time to go live while a long role prompt (--long frames)
   primes, and the long prompt's own caller's.
2. N newcomers of N personas joining at once while 4 rows talk: priming frames per second
   with the primer of core.config.PRIMER_ROWS rows against a one-row primer (the same code
   with one row), and the longest tick during it against the median step.

Tick time is simulated: a tick lasts 80 ms, or its work when that is longer, so a newcomer's
figure is the time a caller would wait, without sleeping through it.

    python bench/priming.py [--long 2900] [--newcomers 4] [--threads 2] [--only burst,long,throughput]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference  # noqa: E402
from reply import SMALL_LM, TOKENIZER  # noqa: E402

from personaplex_cli.prompts.persona import PersonaPrompt  # noqa: E402
from personaplex_cli.core import config as core_config  # noqa: E402
from personaplex_cli.core.sampling import Sampling  # noqa: E402
from personaplex_cli.model.files import ModelDir  # noqa: E402
from personaplex_cli.model.model import Model  # noqa: E402
from personaplex_cli.runtime.scheduler import Scheduler  # noqa: E402

TICK_S = 0.080
MARGIN_S = 0.004  # serve's PRIME_MARGIN_S
TALKING = PersonaPrompt(text_tokens=list(range(10, 40)), key="talking")


class Ticks:
    """serve's pacing over `slots`: step, then prime in the tick's spare time."""

    def __init__(self, slots: Scheduler, rows: int):
        self.slots = slots
        self.clock = 0.0  # simulated seconds
        self.cost_s = 0.01
        self.steps: list[float] = []
        self.ticks: list[float] = []
        self.primed_s = 0.0  # time inside prime calls
        self.pcm = (0.1 * np.random.default_rng(0).standard_normal(
            (rows, 1920))).astype(np.float32)

    def tick(self) -> list[int]:
        began = time.perf_counter()
        self.slots.step(np.resize(self.pcm, (self.slots.capacity, 1920)))
        step = time.perf_counter() - began
        self.steps.append(step)
        went_live = []
        if self.slots.pending_frames():
            spare = TICK_S - step - MARGIN_S
            before = self.slots.primer_steps
            primed = time.perf_counter()
            went_live = self.slots.prime(max(1, int(spare / self.cost_s)))
            spent = time.perf_counter() - primed
            self.primed_s += spent
            if self.slots.primer_steps > before:
                cost = spent / (self.slots.primer_steps - before)
                self.cost_s += 0.25 * (cost - self.cost_s)
        work = time.perf_counter() - began
        self.ticks.append(work)
        self.clock += max(TICK_S, work)
        return went_live


def long_prompt_case(model: Model, long_frames: int) -> None:
    slots = Scheduler.for_model(model, 8)
    for row in range(4):
        slots.join(TALKING, Sampling(), row)
    ticks = Ticks(slots, 8)
    for _ in range(3):
        ticks.tick()
    tokens = [10 + i % 480 for i in range(long_frames - 12)]
    long = slots.begin(PersonaPrompt(text_tokens=tokens, key="long"), Sampling(), 50)
    begun = {long: ticks.clock}
    live: dict[int, float] = {}
    newcomer = None
    while long not in live:
        for slot in ticks.tick():
            live[slot] = ticks.clock
        if newcomer is None and slots.primer_steps >= long_frames // 3:
            newcomer = slots.begin(TALKING, Sampling(), 51)  # its persona is cached
            begun[newcomer] = ticks.clock
    print(f"1. a {long_frames}-frame priming under way, 4 rows talking (batch of 8):")
    print(f"   cached-persona newcomer live after {live[newcomer] - begun[newcomer]:.3f} s "
          f"(goal < 0.5 s)")
    print(f"   the long prompt's own caller live after {live[long] - begun[long]:.1f} s "
          f"({long_frames} frames, {slots.primer_steps} primer steps)")


def talking_batch(model: Model, newcomers: int, one_row: bool) -> Scheduler:
    """A batch with 4 rows talking and room for `newcomers`; its primer of one row when
    `one_row` (the primer before it was batched), else of core.config.primer_rows."""
    original = core_config.primer_rows
    if one_row:
        core_config.primer_rows = lambda capacity: 1
    try:
        slots = Scheduler.for_model(model, 4 + newcomers, cached_personas=0)
    finally:
        core_config.primer_rows = original
    for row in range(4):
        slots.join(TALKING, Sampling(), row)
    return slots


def throughput_case(model: Model, newcomers: int, one_row: bool) -> tuple[float, float, float]:
    """-> (priming frames per second of prime time, longest tick during, median step)."""
    slots = talking_batch(model, newcomers, one_row)
    ticks = Ticks(slots, 4 + newcomers)
    for _ in range(5):
        ticks.tick()
    quiet_steps = list(ticks.steps)
    personas = [PersonaPrompt(text_tokens=list(range(50 + 7 * n, 110 + 7 * n)))
                for n in range(newcomers)]  # 60 tokens + 12 silence frames each
    waiting = {slots.begin(p, Sampling(), 60 + n) for n, p in enumerate(personas)}
    frames = slots.pending_frames()
    first = len(ticks.ticks)
    while waiting:
        waiting -= set(ticks.tick())
    during = ticks.ticks[first:]
    return frames / ticks.primed_s, max(during), statistics.median(quiet_steps + ticks.steps)


def burst_case(model: Model, newcomers: int, one_row: bool) -> float:
    """N newcomers of N personas primed in one go beside 4 live rows (no ticks) -> priming
    frames per second."""
    slots = talking_batch(model, newcomers, one_row)
    for n in range(newcomers):
        slots.begin(PersonaPrompt(text_tokens=list(range(50 + 7 * n, 110 + 7 * n))),
                    Sampling(), 60 + n)
    frames = slots.pending_frames()
    began = time.perf_counter()
    while slots.pending_frames():
        slots.prime(8)
    return frames / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--long", type=int, default=2900, help="frames of the long priming")
    parser.add_argument("--newcomers", type=int, default=4)
    parser.add_argument("--only", default="burst,long,throughput")
    args = parser.parse_args()
    only = args.only.split(",")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        reference.build_mimi(root, seed=1)
        reference.build_lm(root, reference.tiny_lm_kwargs(**SMALL_LM), seed=2)
        (root / "tokenizer_spm_32k_3.model").symlink_to(TOKENIZER)
        model = Model(ModelDir(root, "bench"), torch.device("cpu"), torch.float32)
        model.mimi, model.lm  # load both before timing
        print(f"cpu, LM 512 x 4 in fp32, {args.threads} threads, torch {torch.__version__}")
        if "long" in only:
            long_prompt_case(model, args.long)
        if "burst" in only:
            print(f"0. {args.newcomers} newcomers of {args.newcomers} personas primed in one "
                  "go beside 4 live rows, no ticks:", flush=True)
            rates = {}
            for one_row in (True, False, True, False):
                name = "one-row primer" if one_row else "batched primer"
                rate = burst_case(model, args.newcomers, one_row)
                rates.setdefault(name, []).append(rate)
                print(f"   {name:>15}: {rate:7.1f} priming frames/s", flush=True)
            ratio = (statistics.median(rates["batched primer"])
                     / statistics.median(rates["one-row primer"]))
            print(f"   batched / one-row: {ratio:.2f}x", flush=True)
        if "throughput" not in only:
            return
        print(f"2. {args.newcomers} newcomers of {args.newcomers} personas while 4 rows talk:")
        results = {}
        for one_row in (True, False, True, False):  # in turn, twice: the machine drifts
            name = "one-row primer" if one_row else "batched primer"
            results.setdefault(name, []).append(throughput_case(model, args.newcomers,
                                                                one_row))
        for name, runs in results.items():
            for rate, longest, median in runs:
                print(f"   {name:>15}: {rate:7.1f} priming frames/s; longest tick "
                      f"{1000 * longest:.1f} ms vs median step {1000 * median:.1f} ms "
                      f"({longest / median:.2f}x)")
        one = statistics.median(r[0] for r in results["one-row primer"])
        batched = statistics.median(r[0] for r in results["batched primer"])
        print(f"   batched / one-row: {batched / one:.2f}x (goal >= 2x)")


if __name__ == "__main__":
    main()
