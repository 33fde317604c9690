"""Slots: rows of one batch that join and leave on their own, each with its own persona,
sampling and seed; a stream equals itself run alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_cli.conversation import Conversation, PersonaPrompt, Slots, SlotsFull
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.model import Model

ASSETS = Path(__file__).parent / "data" / "golden" / "assets"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    root = tmp_path_factory.mktemp("slots")
    for file in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                 "tokenizer_spm_tiny_512.model"):
        (root / file).symlink_to(ASSETS / file)
    shutil.copy(ASSETS / "personaplex-arch.json", root)
    return Model(ModelDir(root, "golden"), torch.device("cpu"), torch.float32)


def callers(frames: int, rows: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((frames, rows, 1920)) * 0.1
            ).astype(np.float32)


def alone(model, prompt, sampling, seed, pcm):
    conversation = Conversation(model, prompt, sampling)
    conversation.start([seed])
    frames = [conversation.step(frame[None]) for frame in pcm]
    return (np.stack([f.tokens[0] for f in frames]), np.stack([f.pcm[0] for f in frames]))


def test_rows_join_and_leave(model):
    slots = Slots(model, 2)
    prompt = PersonaPrompt(model.tokenizer.role_prompt("Be brief."))
    a = slots.join(prompt, Sampling(greedy=True), 0)
    b = slots.begin(prompt, Sampling(greedy=True), 1)
    assert (slots.free(), slots.live()) == (0, [a])
    with pytest.raises(SlotsFull):
        slots.begin(prompt)
    assert slots.prime(slots.pending_frames()) == [b]
    slots.leave(a)
    assert (slots.free(), slots.live()) == (1, [b])


@pytest.mark.parametrize("sampling", [Sampling(greedy=True), Sampling()], ids=["greedy", "sampled"])
def test_a_stream_that_joins_late_equals_itself_alone(model, sampling):
    prompts = [PersonaPrompt(model.tokenizer.role_prompt(text))
               for text in ("Be brief.", "You are a pirate.", "Answer in French.")]
    pcm = callers(30, 3)
    slots = Slots(model, 3)
    first = slots.join(prompts[0], sampling, 10)
    frames = []
    for t in range(30):
        if t == 7:
            late = slots.join(prompts[1], sampling, 11)
        frames.append(slots.step(pcm[t]))
    tokens = np.stack([f.tokens[late] for f in frames[7:]])
    audio = np.stack([f.pcm[late] for f in frames[7:]])
    solo_tokens, solo_audio = alone(model, prompts[1], sampling, 11, pcm[7:, late])
    assert np.array_equal(tokens, solo_tokens)
    np.testing.assert_allclose(audio, solo_audio, atol=1e-4)
    first_tokens = np.stack([f.tokens[first] for f in frames])
    assert np.array_equal(first_tokens, alone(model, prompts[0], sampling, 10, pcm[:, first])[0])
