"""Conversations with a persona: the voice and role primed into the model, then the caller's
80 ms frames in and the assistant's frames, codes and inner-monologue text out.

The layer between the engine (core/slots.py) and the runtime, in numpy and text: what a
persona is, how it is checked and made ready for the engine (`prepare_persona`,
`PersonaPrompt`), and `ConversationBatch`, rows that join and leave a running batch each with
their own persona, sampling and seed. Nothing here schedules: runtime/scheduler.py owns the
batch for every command and is the only caller of its `step`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .core import slots as engine
from .core.config import FRAME_SIZE, PERSONAS_CACHED
from .core.sampling import Noise, Sampling, make_rng, noise_key
from .errors import InputError
from .model.model import Model
from .prompts.persona import PersonaPrompt

# A seed: an int (the run repeats exactly, whoever shares the batch), None (fresh entropy)
# or a saved generator state (the reference's own draws, as the golden cases replay them).
Seed = int | torch.Tensor | None


@dataclass
class Frame:
    """One step of B rows: the assistant's audio [B, 1920], its tokens [B, 17] (text,
    assistant codes 1..8, caller codes 9..16) and the text pieces."""

    pcm: np.ndarray
    tokens: np.ndarray
    pieces: list[str]


SlotsFull = engine.SlotsFull


def seeded_noise(device: torch.device, seed: Seed) -> Noise:
    """A row's noise (core/sampling.py): a key for an int or None, a generator for a saved
    generator state."""
    if not isinstance(seed, torch.Tensor):
        return noise_key(seed)
    rng = make_rng(device)
    rng.set_state(seed)
    return rng


class ConversationBatch:
    """A batch of `capacity` rows, each its own conversation with its own persona, sampling
    and seed: streams join a free row and leave it while the others go on.

    `join` primes a row at once; `begin` queues the priming and `prime(max_frames)` advances
    it between steps, so that the rows already talking keep their cadence (a persona primed
    before, by any row, starts at once; newcomers prime side by side and share the primer
    fairly). `step` takes one frame for every row and returns
    one for every row; only the live rows' mean anything. One thread owns it.
    """

    def __init__(self, model: Model, capacity: int, *, graphs: bool | None = None,
                 cached_personas: int = PERSONAS_CACHED):
        self.model = model
        self.capacity = capacity
        self.engine = engine.Slots(model.mimi, model.lm, capacity, graphs=graphs,
                                   cached_personas=cached_personas)
        self._silence = np.zeros((capacity, FRAME_SIZE), np.float32)

    def free(self) -> int:
        return self.engine.free()

    def attend_over_whole_windows(self) -> None:
        """Attention over whole windows in every row (core.session.Session's): a reply's
        bytes then depend on neither its batch mates' lengths nor when it joined."""
        self.engine.attend_over_whole_windows()

    def live(self) -> list[int]:
        return self.engine.live()

    def begin(self, prompt: PersonaPrompt, sampling: Sampling = Sampling(),
              seed: Seed = None) -> int:
        """Reserves a row for a new conversation and queues its priming -> the slot.
        Raises SlotsFull, or InputError for sampling this engine cannot do."""
        try:
            return self.engine.begin(prompt.persona_tokens(self.model), sampling,
                                     seeded_noise(self.model.device, seed), prompt.key)
        except ValueError as error:
            raise InputError(str(error)) from None

    def pending_frames(self) -> int:
        """Priming frames still to run for the queued joins (each persona once)."""
        return self.engine.pending_steps()

    def prime(self, max_frames: int) -> list[int]:
        """Starts the joins whose persona is cached, then runs up to `max_frames` steps of
        the primer, each a frame of every persona seated in it (core/slots.py: a few side
        by side, taking turns when more wait) -> the slots that went live."""
        return self.engine.prime(max_frames)

    @property
    def primer_steps(self) -> int:
        """Steps the primer has run, the measure of priming's device time."""
        return self.engine.primer_steps

    def join(self, prompt: PersonaPrompt, sampling: Sampling = Sampling(),
             seed: Seed = None) -> int:
        """A new conversation in a free row, primed -> its slot."""
        slot = self.begin(prompt, sampling, seed)
        while slot not in self.live():
            self.prime(self.pending_frames())
        return slot

    def leave(self, slot: int) -> None:
        """Frees the row at once (a queued join is dropped)."""
        self.engine.leave(slot)

    def step(self, pcm: np.ndarray | None = None) -> Frame:
        """pcm [capacity, 1920] float32, the callers (rows not live: any value; None: all
        silent) -> one Frame of `capacity` rows."""
        pcm = self._silence if pcm is None else np.ascontiguousarray(pcm, np.float32)
        audio, tokens = self.engine.step(torch.from_numpy(pcm))
        tokens = tokens.numpy()
        pieces = [""] * self.capacity  # rows without a stream say nothing
        for slot in self.live():
            pieces[slot] = self.model.tokenizer.piece(tokens[slot, 0])
        return Frame(audio.numpy(), tokens, pieces)


class PrimingLimit:
    """--max-prime-s over a batch: a persona whose role prompt needs more device time to
    prime than `max_prime_s` is refused (InputError, with the figure) before its priming.
    The cost per priming frame is given (serve's warm-up measured it) or timed once, on a
    few primer steps of the first persona checked."""

    def __init__(self, slots: ConversationBatch, max_prime_s: float,
                 cost_s: float | None = None):
        self.slots, self.max_prime_s, self.cost_s = slots, max_prime_s, cost_s

    def check(self, prompt: PersonaPrompt) -> None:
        from .runtime.limits import role_prompt_refusal

        if self.max_prime_s <= 0:
            return
        if self.cost_s is None:
            self.cost_s = self.slots.engine.time_primer_step(
                prompt.persona_tokens(self.slots.model))
        refusal = role_prompt_refusal(len(prompt.text_tokens), self.cost_s, self.max_prime_s)
        if refusal is not None:
            raise InputError(refusal)
