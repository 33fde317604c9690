"""The conversation layer: personas checked against the model, a session reused for a new
conversation, and reply_stream's lengths."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_cli.audio.frames import InputFrames
from personaplex_cli.conversation import (Conversation, Persona, PersonaPrompt,
                                          prepare_persona, reply_stream)
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.errors import InputError
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.model import Model
from personaplex_cli.prompts.voices import Voice

ASSETS = Path(__file__).parent / "data" / "golden" / "assets"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    root = tmp_path_factory.mktemp("conversation")
    for file in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                 "tokenizer_spm_tiny_512.model"):
        (root / file).symlink_to(ASSETS / file)
    shutil.copy(ASSETS / "personaplex-arch.json", root)
    return Model(ModelDir(root, "golden"), torch.device("cpu"), torch.float32)


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
    conversation = Conversation(model, prompt, Sampling(), batch=2)
    pcm = np.random.default_rng(0).standard_normal((20, 2, 1920)).astype(np.float32) * 0.1

    def talk(seeds):
        conversation.start(seeds)
        return np.stack([conversation.step(frame).tokens for frame in pcm])

    first = talk([3, 4])
    session = conversation.session
    assert np.array_equal(talk([3, 4]), first)  # reset: the same conversation again
    assert conversation.session is session
    assert not np.array_equal(talk([3, 5])[:, 1], first[:, 1])  # stream 1 re-seeded
    assert np.array_equal(talk([3, 5])[:, 0], first[:, 0])  # stream 0 unaffected


def test_reply_stream_lengths(model):
    prompt = PersonaPrompt(model.tokenizer.role_prompt("Be brief."))
    conversation = Conversation(model, prompt, Sampling(greedy=True), batch=3)
    conversation.start([None] * 3)
    lengths = (1920 * 3 + 7, 1920, 5000)
    inputs = [InputFrames(Samples(np.zeros(n, np.float32), known=i != 1))
              for i, n in enumerate(lengths)]
    out = [[] for _ in lengths]
    steps = 0
    for step in reply_stream(conversation, inputs, tail_samples=1000):
        steps += 1
        for b, frame in enumerate(step):
            if frame is not None:
                out[b].append(frame.pcm)
    assert [sum(map(len, o)) for o in out] == [n + 1000 for n in lengths]
    assert steps == -(-(lengths[0] + 1000) // 1920)


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
    assert prompt.voice_frames == 29 and prompt.frames == 29 + 12 + len(prompt.text_tokens)
