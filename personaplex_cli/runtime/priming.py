"""Priming newcomers: in what order, how fairly, and which primed personas are kept.

A row joins in three moves, none of which stalls the rows already talking:

  queue   the row's persona waits its turn (a persona cached, or already under way for
          another row, waits for nothing new);
  prime   the primer (core.priming.Primer: a side batch of core.config.primer_rows rows, or
          the session's own row when the batch has one) runs a bounded number of priming
          steps, so the scheduler spreads them over the gaps between frames;
  start   the primed stream (its KV history, positions and token ring) is copied into the
          row, with fresh codec history and its own sampling and noise, and it goes live.

Why a cache: priming forces every token, so what it leaves depends on the persona alone; the
next row of a cached persona starts without priming (its generator, where it has one rather
than a key, moved on by exactly the draws priming would have made). Joins of one persona
waiting at the same time share one priming.

Why turns: a join whose persona is cached goes live at the next `prime`, whatever else is
priming; the personas being primed share the primer's rows, several in one step, and when
more wait than it has rows they take turns, so a long role prompt delays its own row, not
the others'.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable

import torch

from ..core.config import PERSONAS_CACHED
from ..core.priming import PersonaTokens, Primer
from ..core.sampling import Noise, Sampling, advance_rng
from ..core.session import Session


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


class Priming:
    """The joins of one session waiting for their persona, and the personas kept primed.
    `prime` starts what is ready in the session's rows and returns their slots."""

    def __init__(self, session: Session, primer: Primer,
                 cached_personas: int = PERSONAS_CACHED):
        self.session = session
        self.primer = primer
        self.in_place = primer.gen is session.gen  # the session's own row primes
        self._cached_joins: list[_Join] = []  # go live at the next prime, first of all
        self._primings: deque[_Priming] = deque()  # in the order of their turns
        self._cache: OrderedDict[Hashable, _Primed] = OrderedDict()
        self._cached_personas = cached_personas
        self.steps = 0  # steps the primer ran (each one for all its busy rows)

    def is_cached(self, key: Hashable | None) -> bool:
        return key is not None and key in self._cache

    def queue(self, slot: int, persona: PersonaTokens, sampling: Sampling, rng: Noise,
              key: Hashable | None = None) -> None:
        """Row `slot` waits for `persona` (whose primed state may be cached under `key`),
        to sample by `sampling` from `rng` once live."""
        self._queue(_Join(slot, persona, key, sampling, rng))

    def _queue(self, join: _Join) -> None:
        if self.is_cached(join.key):
            self._cached_joins.append(join)
            return
        for priming in self._primings:  # the same persona under way: it serves both
            if join.key is not None and priming.key == join.key:
                priming.joins.append(join)
                return
        self._primings.append(_Priming(join.persona, join.key, [join]))

    def pending(self) -> int:
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
        with self._primer_windows():
            went_live += self._prime_turns(max_steps)
        return went_live

    def _primer_windows(self):
        """In place, the session's windows attend as a primer's would (its primed state is
        then a side primer's, bit for bit, whether or not the session attends over whole
        windows); otherwise nothing."""
        return self.session.priming_windows() if self.in_place else contextlib.nullcontext()

    def _prime_turns(self, max_steps: int) -> list[int]:
        went_live = []
        while max_steps > 0 and self._primings:
            seated = self._seat()
            turns = -(-len(self._primings) // self.primer.rows)
            steps = min(max(1, max_steps // turns), min(p.left for p in seated))
            for _ in range(steps):
                self.primer.step()
            self.steps += steps
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
        gen = self.session.gen
        advance_rng(join.rng, primed.runs, gen.sampling.draws(join.sampling))
        self.session.start(join.slot, primed.saved, join.sampling, join.rng)

    def _remember(self, key: Hashable | None, primed: _Primed) -> None:
        if key is None or self._cached_personas <= 0:
            return
        # Kept in host memory: a GPU's is for rows (a 7B persona is ~0.5 MB a frame, and
        # the copy back into a row at a join is milliseconds).
        self._cache[key] = _Primed(_to_host(primed.saved), primed.runs)
        while len(self._cache) > self._cached_personas:
            self._cache.popitem(last=False)

    def drop(self, slot: int) -> None:
        """Row `slot` waits no more (a queued or half-primed join is dropped; a priming
        that no join waits for any more stops)."""
        self._cached_joins = [join for join in self._cached_joins if join.slot != slot]
        for priming in list(self._primings):
            priming.joins = [join for join in priming.joins if join.slot != slot]
            if not priming.joins:
                if priming.row is not None:
                    self.primer.vacate(priming.row)
                self._primings.remove(priming)

    def time_step(self, persona: PersonaTokens, steps: int = 4) -> float:
        """Seconds a primer step takes, timed over `steps` steps of `persona` (after one
        untimed) in a primer otherwise idle; nothing of it is kept."""
        if len(self.primer.free_rows()) < self.primer.rows:
            raise RuntimeError("the primer is busy: time it before anyone joins")
        row = self.primer.free_rows()[0]
        with self._primer_windows():
            return self._time(row, persona, steps)

    def _time(self, row: int, persona: PersonaTokens, steps: int) -> float:
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
        if self.session.device.type == "cuda":
            torch.cuda.synchronize(self.session.device)
