"""Slots: a batch of capacity B whose rows are conversations that join and leave on their own.

One `Session` of B rows steps every row every frame (one shape, so one set of CUDA graphs
serves whoever sits where). A stream joins in three moves, none of which stalls the others:

  begin   reserves a free row and queues the stream's priming;
  prime   runs priming steps on a one-row side generator, the primer, a bounded number at a
          time, so a caller spreads them over the gaps between frames; the rows already
          talking keep their cadence;
  start   copies the primed stream (its KV history, positions and token ring) into its row,
          with fresh codec history and its own sampling and noise, and the row goes live.

Priming forces every token, so what it leaves depends on the persona alone: the primed state
is kept in a small cache keyed by the persona, and the next stream with that persona starts
without priming (a row's generator, where it has one rather than a key, moved on by exactly
the draws priming would have made). A row that leaves is free at once; what it computes while
free is never read.

A stream in a row equals the same stream run alone (tests/test_slots.py): every row has its
own positions, mask, ring write position, token ring, codec state, sampling and noise.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Iterator

import torch

from . import priming
from .graphs import make_generator
from .config import PERSONAS_CACHED
from .layers import CONVERSATION_WINDOW, Window
from .lm import LMModel
from .mimi import Mimi
from .priming import PersonaTokens
from .sampling import Noise, Sampling, advance_rng
from .session import Session

FREE, JOINING, LIVE = "free", "joining", "live"


class SlotsFull(RuntimeError):
    """Every row holds a stream."""


@dataclass
class _Join:
    slot: int
    persona: PersonaTokens
    key: Hashable | None
    sampling: Sampling
    rng: Noise
    steps: Iterator[None] | None = field(default=None)  # priming under way on the primer
    done: int = 0  # priming steps run


@dataclass
class _Primed:
    saved: tuple  # FrameGenerator.save of the primed row
    runs: int  # frames that ran (and drew random numbers) while priming


def _to_host(saved):
    if isinstance(saved, torch.Tensor):
        return saved.cpu()
    if isinstance(saved, (tuple, list)):
        return type(saved)(_to_host(item) for item in saved)
    return saved


class Slots:
    def __init__(self, mimi: Mimi, lm: LMModel, capacity: int, *,
                 window: Window = CONVERSATION_WINDOW, graphs: bool | None = None,
                 cached_personas: int = PERSONAS_CACHED):
        if capacity < 1:
            raise ValueError("a batch needs at least one row")
        self.capacity = capacity
        self.session = Session(mimi, lm, capacity, window=window, graphs=graphs)
        self.primer = make_generator(lm, 1, graphs=self.session.graphs, window=window)
        self.state = [FREE] * capacity
        # Off, a step computes the rows up to the last live one; on, every row, so that a
        # row's products keep one shape whoever shares the batch (reply's same bytes).
        self.whole_batch = False
        self._queue: deque[_Join] = deque()
        self._cache: OrderedDict[Hashable, _Primed] = OrderedDict()
        self._cached_personas = cached_personas

    @property
    def device(self) -> torch.device:
        return self.session.device

    def live(self) -> list[int]:
        return [slot for slot, state in enumerate(self.state) if state == LIVE]

    def free(self) -> int:
        return self.state.count(FREE)

    def attend_over_whole_windows(self) -> None:
        """Every step computes every row over its whole window, so a row's products keep
        one shape whoever shares the batch and however far it is (reply's same bytes)."""
        self.whole_batch = True
        self.session.attend_over_whole_windows()

    def is_cached(self, key: Hashable | None) -> bool:
        return key is not None and key in self._cache

    # -- joining ------------------------------------------------------------------------------

    def begin(self, persona: PersonaTokens, sampling: Sampling, rng: Noise,
              key: Hashable | None = None) -> int:
        """Reserves a row for a stream of `persona` (whose primed state may be cached under
        `key`), sampling by `sampling` from `rng` -> its slot, live once primed."""
        if FREE not in self.state:
            raise SlotsFull(f"all {self.capacity} rows hold a stream")
        self.session.gen.sampling.check(sampling)  # refuses what the engine cannot sample
        slot = self.state.index(FREE)
        self.state[slot] = JOINING
        self._queue.append(_Join(slot, persona, key, sampling, rng))
        return slot

    def pending_steps(self) -> int:
        """Priming steps the queued joins still need; a cached persona counts one, its copy
        into the row (0 means nobody waits for `prime`)."""
        return sum(1 if self.is_cached(join.key) else join.persona.steps - join.done
                   for join in self._queue)

    def prime(self, max_steps: int) -> list[int]:
        """Runs up to `max_steps` priming steps of the queued joins, first come first
        served -> the slots that went live (a cached persona's at once)."""
        went_live = []
        while self._queue:
            join = self._queue[0]
            primed = self._cache.get(join.key) if join.key is not None else None
            if primed is not None:
                self._cache.move_to_end(join.key)
                advance_rng(join.rng, primed.runs, self.primer.sampling.draws(join.sampling))
            else:
                if max_steps <= 0:
                    break
                if join.steps is None:
                    self.primer.reset()
                    self.primer.set_sampling(0, join.sampling, join.rng)
                    join.steps = priming.steps(self.primer, join.persona)
                while join.done < join.persona.steps and max_steps > 0:
                    next(join.steps)
                    join.done += 1
                    max_steps -= 1
                if join.done < join.persona.steps:
                    break
                next(join.steps, None)  # the generator ends after its last step
                primed = _Primed(self.primer.save(0), int(self.primer.offsets[0]) - 1)
                self.primer.set_sampling(0, None)
                self._remember(join.key, primed)
            self._queue.popleft()
            self.session.start(join.slot, primed.saved, join.sampling, join.rng)
            self.state[join.slot] = LIVE
            went_live.append(join.slot)
        return went_live

    def join(self, persona: PersonaTokens, sampling: Sampling, rng: Noise,
             key: Hashable | None = None) -> int:
        """begin + prime to the end: the stream is live on return -> its slot."""
        slot = self.begin(persona, sampling, rng, key)
        while self.state[slot] != LIVE:
            self.prime(self.pending_steps())
        return slot

    def _remember(self, key: Hashable | None, primed: _Primed) -> None:
        if key is None or self._cached_personas <= 0:
            return
        # Kept in host memory: a GPU's is for rows (a 7B persona is ~0.5 MB a frame, and
        # the copy back into a row at a join is milliseconds).
        self._cache[key] = _Primed(_to_host(primed.saved), primed.runs)
        while len(self._cache) > self._cached_personas:
            self._cache.popitem(last=False)

    # -- leaving and stepping -------------------------------------------------------------------

    def leave(self, slot: int) -> None:
        """Frees the row at once (a queued or half-primed join is dropped)."""
        if self._queue and self._queue[0].slot == slot and self._queue[0].steps is not None:
            self.primer.set_sampling(0, None)
        self._queue = deque(join for join in self._queue if join.slot != slot)
        self.session.gen.set_sampling(slot, None)
        self.state[slot] = FREE

    def stepped_rows(self) -> int:
        """How many rows a step computes: up to the last live one (a join takes the lowest
        free row, so the live rows crowd the low end), or all while none is live."""
        live = self.live()
        return live[-1] + 1 if live and not self.whole_batch else self.capacity

    def step(self, pcm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pcm [capacity, 1920] (rows not live: anything) -> host copies of (assistant
        pcm [capacity, 1920], tokens [capacity, 17]); only the live rows' mean anything.
        A step costs the rows up to the last live one, not the capacity."""
        return self.session.step(pcm, self.stepped_rows())
