"""Slots: rows of one batch that join and leave on their own, each with its own persona,
sampling and seed. A stream equals itself run alone, whenever it joins, whoever sits beside
it, in whatever row another stream just left, also once the LM's and Mimi's rings wrap (the
golden checkpoints' contexts are 64 LM frames and 40 Mimi steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import GOLDEN_ASSETS
from personaplex_cli.conversation import ConversationBatch, Persona, SlotsFull, prepare_persona
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.errors import InputError
from personaplex_cli.prompts.voices import Voice

GREEDY, SAMPLED = Sampling(greedy=True), Sampling()


@pytest.fixture(scope="module")
def personas(golden_model):
    """Four personas: the .pt voice, the voice recording, no voice, and a third role."""
    pt = Voice("pt", GOLDEN_ASSETS / "voice_prompt_fp32.pt", "file")
    wav = Voice("wav", GOLDEN_ASSETS / "voice_prompt.wav", "file")
    return [prepare_persona(golden_model, Persona(voice, role)) for voice, role in
            ((pt, "You are a pirate."), (wav, "Answer in French."), (None, "Be brief."),
             (pt, "You enjoy having a good conversation."))]


def callers(frames: int, rows: int, seed: int = 0) -> np.ndarray:
    """Caller audio [frames, rows, 1920]: quiet noise, different for every row."""
    return (np.random.default_rng(seed).standard_normal((frames, rows, 1920)) * 0.1
            ).astype(np.float32)


def alone(model, prompt, sampling, seed, pcm: np.ndarray):
    """The stream run by itself in a batch of one -> tokens [T, 17], pcm [T, 1920]."""
    slots = ConversationBatch(model, 1, cached_personas=0)
    slot = slots.join(prompt, sampling, seed)
    frames = [slots.step(frame[None]) for frame in pcm]
    return np.stack([f.tokens[slot] for f in frames]), np.stack([f.pcm[slot] for f in frames])


def assert_same_stream(tokens, audio, solo):
    assert np.array_equal(tokens, solo[0])
    np.testing.assert_allclose(audio, solo[1], atol=1e-4)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_stream_that_joins_a_running_batch_equals_itself_alone(golden_model, personas,
                                                                 sampling):
    frames, late = 90, 23  # well past both contexts, so every ring wraps
    pcm = callers(frames, 4)
    slots = ConversationBatch(golden_model, 4, cached_personas=0)
    rows = {slots.join(personas[i], sampling, 10 + i): i for i in range(3)}
    steps = []
    for t in range(frames):
        if t == late:
            newcomer = slots.join(personas[3], sampling, 13)
        steps.append(slots.step(pcm[t]))
    assert newcomer not in rows
    tokens = np.stack([f.tokens[newcomer] for f in steps[late:]])
    audio = np.stack([f.pcm[newcomer] for f in steps[late:]])
    assert_same_stream(tokens, audio, alone(golden_model, personas[3], sampling, 13,
                                            pcm[late:, newcomer]))
    for slot, i in rows.items():  # and the others were not disturbed by it
        tokens = np.stack([f.tokens[slot] for f in steps])
        audio = np.stack([f.pcm[slot] for f in steps])
        assert_same_stream(tokens, audio, alone(golden_model, personas[i], sampling, 10 + i,
                                                pcm[:, slot]))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_row_another_stream_just_left_starts_afresh(golden_model, personas, sampling):
    pcm = callers(70, 2, seed=1)
    slots = ConversationBatch(golden_model, 2)
    first = slots.join(personas[1], sampling, 1)
    other = slots.join(personas[2], sampling, 2)
    for t in range(40):  # the first stream fills its rings, then leaves
        slots.step(pcm[t])
    slots.leave(first)
    assert slots.free() == 1
    again = slots.join(personas[0], sampling, 3)
    assert again == first
    steps = [slots.step(pcm[t]) for t in range(40, 70)]
    tokens = np.stack([f.tokens[again] for f in steps])
    audio = np.stack([f.pcm[again] for f in steps])
    assert_same_stream(tokens, audio, alone(golden_model, personas[0], sampling, 3,
                                            pcm[40:, again]))
    assert other != again


def test_a_cached_persona_starts_without_priming_and_equals_itself_alone(golden_model,
                                                                         personas):
    pcm = callers(30, 3, seed=2)
    slots = ConversationBatch(golden_model, 3)
    slots.join(personas[0], SAMPLED, 5)
    slot = slots.begin(personas[0], Sampling(temp_text=0.9, top_k_text=5), 6)
    assert slots.pending_frames() == 1  # the persona is primed already: just its copy
    assert slots.prime(1) == [slot]
    steps = [slots.step(pcm[t]) for t in range(30)]
    tokens = np.stack([f.tokens[slot] for f in steps])
    audio = np.stack([f.pcm[slot] for f in steps])
    assert_same_stream(tokens, audio, alone(golden_model, personas[0],
                                            Sampling(temp_text=0.9, top_k_text=5), 6,
                                            pcm[:, slot]))


def test_priming_spread_over_steps_leaves_the_others_unchanged(golden_model, personas):
    pcm = callers(60, 2, seed=3)
    slots = ConversationBatch(golden_model, 2)
    talking = slots.join(personas[2], SAMPLED, 7)
    steps = []
    for t in range(60):
        if t == 5:
            newcomer = slots.begin(personas[1], SAMPLED, 8)
        if t >= 5 and newcomer not in slots.live():
            if slots.prime(3) == [newcomer]:  # three priming steps between frames
                joined = t
        steps.append(slots.step(pcm[t]))
    assert joined > 10  # it took several frames
    tokens = np.stack([f.tokens[talking] for f in steps])
    assert np.array_equal(tokens, alone(golden_model, personas[2], SAMPLED, 7,
                                        pcm[:, talking])[0])
    tokens = np.stack([f.tokens[newcomer] for f in steps[joined:]])
    assert np.array_equal(tokens, alone(golden_model, personas[1], SAMPLED, 8,
                                        pcm[joined:, newcomer])[0])


def test_rows_sample_by_their_own_parameters(golden_model, personas):
    pcm = callers(25, 3, seed=4)
    samplings = [Sampling(temp_text=1.2, top_k_text=0, top_k_audio=3), GREEDY,
                 Sampling(temp_audio=0.5, top_k_audio=0)]
    slots = ConversationBatch(golden_model, 3)
    rows = [slots.join(personas[2], s, 20 + i) for i, s in enumerate(samplings)]
    steps = [slots.step(pcm[t]) for t in range(25)]
    for slot, sampling, seed in zip(rows, samplings, (20, 21, 22)):
        tokens = np.stack([f.tokens[slot] for f in steps])
        assert np.array_equal(tokens, alone(golden_model, personas[2], sampling, seed,
                                            pcm[:, slot])[0])


def test_rows_join_and_leave(golden_model, personas):
    slots = ConversationBatch(golden_model, 2)
    a = slots.join(personas[2], GREEDY, 0)
    b = slots.begin(personas[1], GREEDY, 1)
    assert (slots.free(), slots.live()) == (0, [a])
    with pytest.raises(SlotsFull):
        slots.begin(personas[2])
    assert slots.pending_frames() == personas[1].frames
    assert slots.prime(slots.pending_frames()) == [b]
    slots.leave(a)
    assert (slots.free(), slots.live()) == (1, [b])
    slots.leave(b)  # a queued join that leaves is dropped
    c = slots.begin(personas[0], GREEDY, 2)
    slots.leave(c)
    assert (slots.free(), slots.pending_frames(), slots.prime(1000)) == (2, 0, [])


def test_a_stream_is_the_same_in_every_row(golden_model, personas):
    """The same stream in row 0 and row 2 of one batch: identical."""
    pcm = callers(20, 1, seed=5)[:, 0]
    slots = ConversationBatch(golden_model, 3)
    rows = [slots.join(personas[0], SAMPLED, 9) for _ in range(3)]
    steps = [slots.step(np.stack([pcm[t]] * 3)) for t in range(20)]
    tokens = np.stack([f.tokens for f in steps])
    assert np.array_equal(tokens[:, rows[0]], tokens[:, rows[2]])
    assert np.array_equal(tokens[:, rows[1]], tokens[:, rows[2]])


def test_torch_state_is_per_row(golden_model, personas):
    """Every carried tensor of the engine has the batch as its first dimension."""
    slots = ConversationBatch(golden_model, 3)
    session = slots.engine.session
    for state in (session.encoder, session.decoder, session.gen.temporal):
        for module_state in state.values():
            for name, value in vars(module_state).items():
                if isinstance(value, torch.Tensor):
                    assert value.shape[0] == 3, (type(module_state).__name__, name)


def test_sampling_an_engine_cannot_do_is_refused():
    from personaplex_cli.core.sampling import RowSampling

    rows = RowSampling(2, torch.device("cpu"), (512, 2048), 8, widths=(250, 2048))
    with pytest.raises(ValueError, match="text top-k 300"):
        rows.set(0, Sampling(top_k_text=300))
    with pytest.raises(ValueError, match="top-k all"):
        rows.check(Sampling(top_k_text=0))
    rows.set(1, Sampling(top_k_text=250, top_k_audio=0))


def test_begin_refuses_sampling_in_one_line(golden_model, personas, monkeypatch):
    slots = ConversationBatch(golden_model, 1)
    monkeypatch.setattr(slots.engine.session.gen.sampling, "fixed", (25, 2048))
    with pytest.raises(InputError, match="over this engine's limit"):
        slots.begin(personas[2], Sampling(top_k_text=26))
    assert slots.free() == 1


def test_the_memory_arithmetic_counts_every_ring_the_engine_holds(golden_model):
    """model/memory.py's need for N sessions covers the N rows and the primer."""
    from personaplex_cli.core.layers import KVRing
    from personaplex_cli.model.memory import PRIMER_STREAMS, kv_bytes_per_stream

    slots = ConversationBatch(golden_model, 3).engine
    states = [slots.session.encoder, slots.session.decoder, slots.session.gen.temporal,
              slots.session.gen.depth, slots.primer.temporal, slots.primer.depth]
    held = sum(t.numel() * t.element_size() for state in states for ring in state.values()
               if isinstance(ring, KVRing) for t in (ring.keys, ring.values))
    arch = golden_model.arch
    per_stream = kv_bytes_per_stream(arch.lm, arch.mimi.transformer, golden_model.dtype)
    mimi_per_stream = sum(t.numel() * t.element_size() for state in states[:2]
                          for ring in state.values() if isinstance(ring, KVRing)
                          for t in (ring.keys, ring.values)) // 3
    assert held == (3 + PRIMER_STREAMS) * per_stream - PRIMER_STREAMS * mimi_per_stream


# -- the rows' noise: one computation for the whole batch -------------------------------------

VOCAB, DEP_STEPS = (512, 2048), 8


def _noise(sampling, offsets):
    """One frame's noise, as FrameGenerator makes it."""
    return sampling.with_keyed(offsets, *sampling.draw_generators())


def _rows(samplings, rngs, widths=None):
    from personaplex_cli.core.sampling import RowSampling

    rows = RowSampling(len(samplings), torch.device("cpu"), VOCAB, DEP_STEPS, widths=widths)
    for row, (sampling, rng) in enumerate(zip(samplings, rngs)):
        rows.set(row, sampling, rng)
    return rows


@pytest.mark.parametrize("widths", [None, (250, 2048)], ids=["eager", "graph-widths"])
def test_a_keyed_rows_noise_is_its_own(widths):
    """Each row's noise, drawn with its batch mates in one go, equals the row's alone in a
    batch of one: it depends on its key and frame offset only. A generator's row still draws
    exactly what `exponential_` gives from its generator (the reference's noise)."""
    from personaplex_cli.core.sampling import noise_key

    samplings = [SAMPLED, Sampling(top_k_text=3, top_k_audio=7), GREEDY,
                 Sampling(top_k_text=40), SAMPLED]
    keys = [noise_key(seed) for seed in (1, 2, 3, 4)] + [torch.Generator().manual_seed(5)]
    offsets = torch.tensor([9, 1, 4, 300, 9])
    text, audio = _noise(_rows(samplings, keys, widths), offsets)
    for row, sampling in enumerate(samplings[:4]):
        if sampling.greedy:
            continue
        k_text = min(sampling.top_k_text, VOCAB[0])
        k_audio = min(sampling.top_k_audio, VOCAB[1])
        solo_text, solo_audio = _noise(_rows([sampling], [keys[row]], widths),
                                       offsets[row:row + 1])
        assert torch.equal(text[row, :k_text], solo_text[0, :k_text])
        assert torch.equal(audio[row, :, :k_audio], solo_audio[0, :, :k_audio])
    reference = torch.Generator().manual_seed(5)
    want = torch.empty(25).exponential_(1, generator=reference)
    assert torch.equal(text[4, :25], want)
    # Another frame, another key: other noise.
    later, _ = _noise(_rows(samplings[:1], keys[:1], widths), offsets[:1] + 1)
    other, _ = _noise(_rows(samplings[:1], [noise_key(6)], widths), offsets[:1])
    assert not torch.equal(later[0, :25], text[0, :25])
    assert not torch.equal(other[0, :25], text[0, :25])


def test_one_computation_makes_the_whole_batchs_noise():
    """The operations a frame's noise takes do not grow with the rows (the generators' way:
    one `exponential_` for each row and draw, 9 a row here)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from personaplex_cli.core.sampling import noise_key

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for batch in (1, 64):
        rows = _rows([SAMPLED] * batch, [noise_key(seed) for seed in range(batch)])
        offsets = torch.arange(batch) + 1
        _noise(rows, offsets)
        Count.ops = 0
        with Count():
            _noise(rows, offsets)
        counts[batch] = Count.ops
    assert counts[64] == counts[1]


def test_keyed_noise_is_exponential():
    from personaplex_cli.core.sampling import noise_key

    rows = _rows([Sampling(top_k_text=0, top_k_audio=0)] * 4,
                 [noise_key(seed) for seed in range(4)])
    text, audio = _noise(rows, torch.tensor([1, 2, 3, 1_000_000]))
    values = torch.cat([text.flatten(), audio.flatten()]).double()
    assert values.min() > 0
    assert abs(values.mean().item() - 1) < 0.01 and abs(values.var().item() - 1) < 0.03
    # P(E > 1) = 1/e; consecutive candidates and draws uncorrelated.
    assert abs((values > 1).double().mean().item() - np.exp(-1)) < 0.005
    flat = audio.flatten().double()
    assert abs(np.corrcoef(flat[:-1].numpy(), flat[1:].numpy())[0, 1]) < 0.01
