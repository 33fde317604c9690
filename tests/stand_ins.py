"""Stand-ins for the model under the runtime's real Scheduler, so that its pacing, talk's
loop and their statistics are tested without stepping a model: a session that answers
with whatever a test's `step` says, and priming that takes no frames."""

from __future__ import annotations

import numpy as np
import torch

from personaplex_cli.prompts.persona import PersonaPrompt
from personaplex_cli.runtime.rows import SourceRow
from personaplex_cli.runtime.scheduler import Scheduler

NOBODY = PersonaPrompt([])  # a persona with nothing to prime


class StandInSession:
    """A core.session.Session of `batch` rows whose step is `step(pcm [rows, 1920])` ->
    an object with .pcm [rows, 1920] and, optionally, .tokens [rows, 17] and .pieces."""

    device = torch.device("cpu")

    def __init__(self, step, batch: int = 1):
        self.batch = batch
        self._step = step
        self.last = None

    def step(self, pcm: torch.Tensor, rows: int | None = None, *, agent=None, text=None):
        out = self._step(pcm.numpy()[:self.batch])
        self.last = out
        tokens = getattr(out, "tokens", None)
        if tokens is None:
            tokens = np.zeros((self.batch, 17), np.int64)
        return torch.as_tensor(np.asarray(out.pcm, np.float32)), torch.as_tensor(tokens)

    def check_sampling(self, sampling) -> None:
        pass

    def free(self, row: int) -> None:
        pass

    def attend_over_whole_windows(self) -> None:
        pass


class AtOnce:
    """runtime.priming.Priming's stand-in: a queued row goes live at the next `prime`
    (one frame each)."""

    steps = 0
    in_place = False

    def __init__(self):
        self.queued: list[int] = []

    def queue(self, slot, persona, sampling, rng, key=None) -> None:
        self.queued.append(slot)

    def pending(self) -> int:
        return len(self.queued)

    def prime(self, max_steps: int) -> list[int]:
        went, self.queued = self.queued[:max_steps], self.queued[max_steps:]
        return went

    def drop(self, slot: int) -> None:
        self.queued = [queued for queued in self.queued if queued != slot]


class LastPieces:
    """A tokenizer stand-in: each live row's piece is what the stand-in step said."""

    def __init__(self, session: StandInSession):
        self.session = session

    def piece(self, token) -> str:
        pieces = getattr(self.session.last, "pieces", None)
        return pieces[0] if pieces else ""


def stand_in_scheduler(step, capacity: int = 1, **options) -> Scheduler:
    session = StandInSession(step, capacity)
    return Scheduler(None, session, AtOnce(), tokenizer=LastPieces(session), **options)


def stand_in_loop(stepper, source, sink=None, **options):
    """talk's LiveLoop over a batch-1 `stepper` (`step(pcm [1, 1920])`), on the scheduler."""
    from personaplex_cli.live.loop import LiveLoop

    return LiveLoop(stand_in_scheduler(stepper.step), SourceRow(NOBODY, None, None), source,
                    sink, **options)

