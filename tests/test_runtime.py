"""The runtime's decisions: a step costs the live rows, not the capacity; one warm-up decides
torch's thread count and how many rows keep real time, from injected step timings (no
wall-clock thresholds); serve, talk and reply take that one decision."""

from __future__ import annotations

import numpy as np
import pytest

from personaplex_cli.conversation import Persona, Slots, prepare_persona
from personaplex_cli.core.sampling import Sampling


@pytest.fixture(scope="module")
def prompt(golden_model):
    return prepare_persona(golden_model, Persona(None, "Be brief."))


def batch_sizes_stepped(model, monkeypatch) -> list[int]:
    """Records the batch of every temporal step the LM runs."""
    seen: list[int] = []
    forward = model.lm.forward_embeddings

    def counting(x, state):
        seen.append(x.shape[0])
        return forward(x, state)

    monkeypatch.setattr(model.lm, "forward_embeddings", counting)
    return seen


def test_a_step_costs_the_rows_up_to_the_last_live_one(golden_model, prompt, monkeypatch):
    slots = Slots(golden_model, 16, cached_personas=4)
    first = slots.join(prompt, Sampling(), 1)
    second = slots.join(prompt, Sampling(), 2)
    assert (first, second) == (0, 1)  # a join takes the lowest free row
    seen = batch_sizes_stepped(golden_model, monkeypatch)
    slots.step()
    slots.leave(first)
    slots.step()  # row 1 is live still: rows 0 and 1 step
    slots.leave(second)
    third = slots.join(prompt, Sampling(), 3)
    assert third == 0
    slots.step()
    assert seen == [2, 2, 1]


def test_rows_past_the_prefix_keep_their_state_and_answer_zeros(golden_model, prompt):
    """A stream stepped in a prefix of a wide batch equals itself in a batch of its size."""
    pcm = (np.random.default_rng(5).standard_normal((6, 8, 1920)) * 0.1).astype(np.float32)
    wide, narrow = Slots(golden_model, 8, cached_personas=0), Slots(golden_model, 2,
                                                                     cached_personas=0)
    for slots in (wide, narrow):
        slots.join(prompt, Sampling(), 11)
        slots.join(prompt, Sampling(), 12)
    for t in range(6):
        a, b = wide.step(pcm[t]), narrow.step(pcm[t, :2])
        assert np.array_equal(a.tokens[:2], b.tokens)
        np.testing.assert_allclose(a.pcm[:2], b.pcm, atol=1e-5)
        assert not a.pcm[2:].any() and not a.tokens[2:].any()
