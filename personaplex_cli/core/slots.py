"""Slots: a batch of capacity B whose rows are conversations that join and leave on their own.

One `Session` of B rows steps every row every frame (one shape, so one set of CUDA graphs
serves whoever sits where). A stream joins in three moves, none of which stalls the others:

  begin   reserves a free row and queues the stream's priming;
  prime   runs priming steps on the primer, a side batch of a few rows (core.config
          .primer_rows), a bounded number at a time, so a caller spreads them over the gaps
          between frames; the rows already talking keep their cadence;
  start   copies the primed stream (its KV history, positions and token ring) into its row,
          with fresh codec history and its own sampling and noise, and the row goes live.

Priming forces every token, so what it leaves depends on the persona alone: the primed state
is kept in a small cache keyed by the persona, and the next stream with that persona starts
without priming (a row's generator, where it has one rather than a key, moved on by exactly
the draws priming would have made). Joins of one persona waiting at the same time share one
priming. A row that leaves is free at once; what it computes while free is never read.

Priming is fair: a join whose persona is cached goes live at the next `prime`, whatever else
is priming; the personas being primed share the primer's rows, several in one step, and
when more wait than it has rows they take turns, so a long role prompt delays its own
stream, not the others'.

A stream in a row equals the same stream run alone (tests/test_slots.py): every row has its
own positions, mask, ring write position, token ring, codec state, sampling and noise; a
persona primed beside others equals it primed alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable

import torch

from .graphs import graphed_or_eager, make_generator
from .config import PERSONAS_CACHED, primer_rows
from .layers import CONVERSATION_WINDOW, Window
from .lm import LMModel
from .mimi import Mimi
from .priming import PersonaTokens, Primer
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


@dataclass(eq=False)
class _Priming:
    """One persona on its way into the cache and into every join waiting for it."""

    persona: PersonaTokens
    key: Hashable | None
    joins: list[_Join]
    row: int | None = None  # its primer row while it holds one
    parked: tuple | None = None  # its primer row's state while it waits its turn
    position: int = 0  # priming steps done

    @property
    def left(self) -> int:
        return self.persona.steps - self.position


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

        def build(graphed: bool) -> tuple[Session, Primer]:
            session = Session(mimi, lm, capacity, window=window, graphs=graphed)
            return session, Primer(make_generator(lm, primer_rows(capacity), graphs=graphed,
                                                  window=window, pool=session.pool))

        # graphs_fallback: why CUDA graphs were left for eager steps (None: they were not)
        (self.session, self.primer), self.graphs_fallback = graphed_or_eager(
            build, next(lm.parameters()).device, graphs)
        self.state = [FREE] * capacity
        # Off, a step computes the rows up to the last live one; on, every row, so that a
        # row's products keep one shape whoever shares the batch (reply's same bytes).
        self.whole_batch = False
        self._cached_joins: list[_Join] = []  # go live at the next prime, first of all
        self._primings: deque[_Priming] = deque()  # in the order of their turns
        self._cache: OrderedDict[Hashable, _Primed] = OrderedDict()
        self._cached_personas = cached_personas
        self.primer_steps = 0  # steps the primer ran (each one for all its busy rows)

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
        `key`), sampling by `sampling` from `rng` -> its slot, live once primed: at the
        next `prime` if the persona is cached, else when its priming is done."""
        if FREE not in self.state:
            raise SlotsFull(f"all {self.capacity} rows hold a stream")
        self.session.gen.sampling.check(sampling)  # refuses what the engine cannot sample
        slot = self.state.index(FREE)
        self.state[slot] = JOINING
        self._queue(_Join(slot, persona, key, sampling, rng))
        return slot

    def _queue(self, join: _Join) -> None:
        if self.is_cached(join.key):
            self._cached_joins.append(join)
            return
        for priming in self._primings:  # the same persona under way: it serves both
            if join.key is not None and priming.key == join.key:
                priming.joins.append(join)
                return
        self._primings.append(_Priming(join.persona, join.key, [join]))

    def pending_steps(self) -> int:
        """Priming steps the queued joins still need, each persona once; a cached persona
        counts one, its copy into the row (0 means nobody waits for `prime`)."""
        return len(self._cached_joins) + sum(priming.left for priming in self._primings)

    def prime(self, max_steps: int) -> list[int]:
        """Starts every join whose persona is cached, then runs up to `max_steps` steps of
        the primer, the personas under way taking turns in its rows -> the slots that went
        live."""
        went_live = []
        cached, self._cached_joins = self._cached_joins, []
        for join in cached:
            primed = self._cache.get(join.key)
            if primed is None:  # dropped from the cache since: primed afresh
                self._queue(join)
                continue
            self._cache.move_to_end(join.key)
            self._start(join, primed)
            went_live.append(join.slot)
        # Each turn seats the next personas in line; with more waiting than the primer has
        # rows, the budget is shared so that every one has a turn within a call or two.
        while max_steps > 0 and self._primings:
            seated = self._seat()
            turns = -(-len(self._primings) // self.primer.rows)
            steps = min(max(1, max_steps // turns), min(p.left for p in seated))
            for _ in range(steps):
                self.primer.step()
            self.primer_steps += steps
            max_steps -= steps
            for priming in seated:
                priming.position += steps
                if priming.left == 0:
                    went_live += self._finish(priming)
            if len(self._primings) > self.primer.rows:  # the next ones' turn
                self._primings.rotate(-sum(1 for p in seated if p.left > 0))
        return went_live

    def _seat(self) -> list[_Priming]:
        """The first primer-rows personas in line, each in a primer row (another's,
        parked, if need be) -> them."""
        turn = list(self._primings)[:self.primer.rows]
        for priming in self._primings:
            if priming.row is not None and priming not in turn:
                priming.parked = self.primer.park(priming.row)
                priming.row = None
        free = self.primer.free_rows()
        for priming in turn:
            if priming.row is None:
                priming.row = free.pop(0)
                self.primer.seat(priming.row, priming.persona, priming.parked,
                                 priming.position)
                priming.parked = None
                priming.position = self.primer.position(priming.row)
        return turn

    def _finish(self, priming: _Priming) -> list[int]:
        saved, runs = self.primer.finish(priming.row)
        self._primings.remove(priming)
        primed = _Primed(saved, runs)
        self._remember(priming.key, primed)
        for join in priming.joins:
            self._start(join, primed)
        return [join.slot for join in priming.joins]

    def _start(self, join: _Join, primed: _Primed) -> None:
        advance_rng(join.rng, primed.runs, self.session.gen.sampling.draws(join.sampling))
        self.session.start(join.slot, primed.saved, join.sampling, join.rng)
        self.state[join.slot] = LIVE

    def time_primer_step(self, persona: PersonaTokens, steps: int = 4) -> float:
        """Seconds a primer step takes, timed over `steps` steps of `persona` (after one
        untimed) in a primer otherwise idle; nothing of it is kept."""
        if len(self.primer.free_rows()) < self.primer.rows:
            raise RuntimeError("the primer is busy: time it before anyone joins")
        row = self.primer.free_rows()[0]
        self.primer.seat(row, persona)
        try:
            self.primer.step()
            self._finish_work()
            began = time.perf_counter()
            timed = 0
            while timed < steps and not self.primer.done(row):
                self.primer.step()
                timed += 1
            self._finish_work()  # a GPU's steps are queued: their time is when they end
            return (time.perf_counter() - began) / max(timed, 1)
        finally:
            self.primer.vacate(row)

    def _finish_work(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
        """Frees the row at once (a queued or half-primed join is dropped; a priming that
        no join waits for any more stops)."""
        self._cached_joins = [join for join in self._cached_joins if join.slot != slot]
        for priming in list(self._primings):
            priming.joins = [join for join in priming.joins if join.slot != slot]
            if not priming.joins:
                if priming.row is not None:
                    self.primer.vacate(priming.row)
                self._primings.remove(priming)
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
