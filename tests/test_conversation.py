"""Conversations on the scheduler: personas checked against the model, a session reused
for a new conversation, and the replies' lengths and continuous batching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_cli.audio.frames import InputFrames
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.errors import InputError
from personaplex_cli.model.model import Model
from personaplex_cli.prompts.persona import Persona, PersonaPrompt, prepare_persona
from personaplex_cli.prompts.voices import Voice
from personaplex_cli.runtime.rows import ReplyRequest
from personaplex_cli.runtime.scheduler import Scheduler

ASSETS = Path(__file__).parent / "data" / "golden" / "assets"


@pytest.fixture(scope="module")
def model(golden_model) -> Model:
    return golden_model


class Samples:
    """An opened input of known samples (what `open_audio` gives, for 24 kHz mono)."""

    def __init__(self, x: np.ndarray, known: bool = True):
        self.x, self.sample_rate, self.channels = x, 24000, 1
        self.num_frames = self.declared_frames = len(x) if known else None

    def blocks(self, n):
        for start in range(0, len(self.x), n):
            yield self.x[start:start + n]


def test_a_new_conversation_reuses_the_session(model):
    prompt = PersonaPrompt(model.tokenizer.role_prompt("Be brief."))
    scheduler = Scheduler.for_model(model, 2)
    pcm = np.random.default_rng(0).standard_normal((20, 2, 1920)).astype(np.float32) * 0.1

    def talk(seeds):
        slots = [scheduler.join(prompt, Sampling(), seed) for seed in seeds]
        tokens = np.stack([scheduler.step(frame).tokens for frame in pcm])
        for slot in slots:
            scheduler.leave(slot)
        return tokens

    first = talk([3, 4])
    session = scheduler.session
    assert np.array_equal(talk([3, 4]), first)  # left and joined: the same conversation
    assert scheduler.session is session
    assert not np.array_equal(talk([3, 5])[:, 1], first[:, 1])  # stream 1 re-seeded
    assert np.array_equal(talk([3, 5])[:, 0], first[:, 0])  # stream 0 unaffected


def test_replies_lengths(model):
    prompt = PersonaPrompt(model.tokenizer.role_prompt("Be brief."))
    lengths = (1920 * 3 + 7, 1920, 5000)
    requests = [ReplyRequest(i, InputFrames(Samples(np.zeros(n, np.float32), known=i != 1)),
                             prompt, Sampling(greedy=True), tail_samples=1000)
                for i, n in enumerate(lengths)]
    out = {i: [] for i in range(len(lengths))}
    done, steps = [], 0
    for made, finished, _ in Scheduler.for_model(model, 3).answer(requests):
        steps += bool(made)
        done += finished
        for key, frame in made:
            out[key].append(frame.pcm)
    assert [sum(map(len, out[i])) for i in range(3)] == [n + 1000 for n in lengths]
    assert steps == -(-(lengths[0] + 1000) // 1920)
    assert sorted(done) == [0, 1, 2]


def test_replies_batch_continuously(model):
    """Five recordings in two rows: a row that finishes takes the next recording at once,
    and each reply equals its solo."""
    prompt = PersonaPrompt(model.tokenizer.role_prompt("Be brief."))
    rng = np.random.default_rng(7)
    lengths = (1920 * 9, 1920 * 2, 1920 * 3, 1920 * 2, 1920 * 4)
    pcm = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in lengths]

    def run(capacity, keys):
        requests = (ReplyRequest(k, InputFrames(Samples(pcm[k])), prompt, Sampling(), seed=k)
                    for k in keys)
        out, steps, order = {k: [] for k in keys}, 0, []
        for made, finished, _ in Scheduler.for_model(model, capacity).answer(requests):
            steps += bool(made)
            order += finished
            for key, frame in made:
                out[key].append(frame.tokens)
        return {k: np.stack(v) for k, v in out.items()}, steps, order

    together, steps, order = run(2, range(5))
    # One row answers 0 (9 frames), the other 1, 2, 3, 4 (2 + 3 + 2 + 4 frames) meanwhile;
    # lockstep pairs would take 9 + 3 + 4 = 16 steps.
    assert steps == 11
    assert order == [1, 2, 3, 0, 4]
    for key in range(5):
        alone, _, _ = run(1, [key])
        assert np.array_equal(together[key], alone[key])


def test_personas_are_checked_against_the_model(model, tmp_path):
    with pytest.raises(InputError, match="empty"):
        prepare_persona(model, Persona(None, "  "))
    with pytest.raises(InputError, match="context"):
        prepare_persona(model, Persona(None, "many words " * 100))
    other = tmp_path / "other.pt"
    torch.save({"embeddings": torch.zeros(3, 1, 1, 32), "cache": torch.zeros(1, 17, 4,
                                                                              dtype=torch.long)},
               other)
    with pytest.raises(InputError, match="another model"):
        prepare_persona(model, Persona(Voice("other", other, "file")))
    prompt = prepare_persona(model, Persona(Voice("v", ASSETS / "voice_prompt_fp32.pt", "file")))
    assert prompt.frames == 28 + 12 + len(prompt.text_tokens)  # one step per stored frame
