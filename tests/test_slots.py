"""Slots: rows of one batch that join and leave on their own, each with its own persona,
sampling and seed. A stream equals itself run alone, whenever it joins, whoever sits beside
it, in whatever row another stream just left, also once the LM's and Mimi's rings wrap (the
golden checkpoints' contexts are 64 LM frames and 40 Mimi steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import GOLDEN_ASSETS
from personaplex_cli.runtime.scheduler import Scheduler, SlotsFull
from personaplex_cli.prompts.persona import Persona, prepare_persona
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
    slots = Scheduler.for_model(model, 1, cached_personas=0)
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
    slots = Scheduler.for_model(golden_model, 4, cached_personas=0)
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
    slots = Scheduler.for_model(golden_model, 2)
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
    slots = Scheduler.for_model(golden_model, 3)
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
    slots = Scheduler.for_model(golden_model, 2)
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
    slots = Scheduler.for_model(golden_model, 3)
    rows = [slots.join(personas[2], s, 20 + i) for i, s in enumerate(samplings)]
    steps = [slots.step(pcm[t]) for t in range(25)]
    for slot, sampling, seed in zip(rows, samplings, (20, 21, 22)):
        tokens = np.stack([f.tokens[slot] for f in steps])
        assert np.array_equal(tokens, alone(golden_model, personas[2], sampling, seed,
                                            pcm[:, slot])[0])


def test_rows_join_and_leave(golden_model, personas):
    slots = Scheduler.for_model(golden_model, 2)
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
    slots = Scheduler.for_model(golden_model, 3)
    rows = [slots.join(personas[0], SAMPLED, 9) for _ in range(3)]
    steps = [slots.step(np.stack([pcm[t]] * 3)) for t in range(20)]
    tokens = np.stack([f.tokens for f in steps])
    assert np.array_equal(tokens[:, rows[0]], tokens[:, rows[2]])
    assert np.array_equal(tokens[:, rows[1]], tokens[:, rows[2]])


def test_torch_state_is_per_row(golden_model, personas):
    """Every carried tensor of the engine has the batch as its first dimension."""
    slots = Scheduler.for_model(golden_model, 3)
    session = slots.session
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
    slots = Scheduler.for_model(golden_model, 1)
    monkeypatch.setattr(slots.session.gen.sampling, "fixed", (25, 2048))
    with pytest.raises(InputError, match="over this engine's limit"):
        slots.begin(personas[2], Sampling(top_k_text=26))
    assert slots.free() == 1


def test_the_memory_arithmetic_counts_every_ring_the_engine_holds(golden_model):
    """model/memory.py's need for N sessions covers the N rows and the primer."""
    from personaplex_cli.core.layers import KVRing
    from personaplex_cli.core.config import primer_rows
    from personaplex_cli.model.memory import kv_bytes_per_stream

    slots = Scheduler.for_model(golden_model, 3)
    states = [slots.session.encoder, slots.session.decoder, slots.session.gen.temporal,
              slots.session.gen.depth, slots.priming.primer.gen.temporal, slots.priming.primer.gen.depth]
    held = sum(t.numel() * t.element_size() for state in states for ring in state.values()
               if isinstance(ring, KVRing) for t in (ring.keys, ring.values))
    arch = golden_model.arch
    per_stream = kv_bytes_per_stream(arch.lm, arch.mimi.transformer, golden_model.dtype)
    mimi_per_stream = sum(t.numel() * t.element_size() for state in states[:2]
                          for ring in state.values() if isinstance(ring, KVRing)
                          for t in (ring.keys, ring.values)) // 3
    primer = primer_rows(3)
    assert primer == 3  # a row per stream that could join at once, up to PRIMER_ROWS
    assert held == (3 + primer) * per_stream - primer * mimi_per_stream


def test_one_stream_primes_in_its_own_row_and_holds_one_window(golden_model):
    """A batch of one has no primer beside it (nobody else waits): it holds one stream's
    rings, and model/memory.py counts one window for it."""
    from personaplex_cli.core.layers import KVRing
    from personaplex_cli.model.memory import kv_bytes_per_stream

    scheduler = Scheduler.for_model(golden_model, 1)
    assert scheduler.priming.primer.gen is scheduler.session.gen
    session = scheduler.session
    held = sum(t.numel() * t.element_size()
               for state in (session.encoder, session.decoder, session.gen.temporal,
                             session.gen.depth)
               for ring in state.values() if isinstance(ring, KVRing)
               for t in (ring.keys, ring.values))
    arch = golden_model.arch
    assert held == kv_bytes_per_stream(arch.lm, arch.mimi.transformer, golden_model.dtype)
    need = golden_model.preflight(1)
    assert need.primer == 0
    assert need.total == need.weights + need.kv_per_stream + need.mimi + need.margin


@pytest.mark.parametrize("whole_windows", [False, True], ids=["trimmed", "whole-windows"])
def test_a_persona_primed_in_place_is_the_side_primers_bit_for_bit(golden_model, personas,
                                                                   whole_windows):
    """Primed in the one row of a batch of one, a persona leaves the state a primer of its
    own leaves, bit for bit, also while the batch attends over whole windows (as reply's):
    its windows attend as a primer's while it primes."""
    scheduler = Scheduler.for_model(golden_model, 1)
    if whole_windows:
        scheduler.attend_over_whole_windows()
    for i in (0, 1):
        slot = scheduler.join(personas[i], GREEDY, i)
        saved, runs = _primed_alone(golden_model, personas[i].persona_tokens(golden_model))
        assert scheduler.priming._cache[personas[i].key].runs == runs
        assert _same(scheduler.priming._cache[personas[i].key].saved, saved)
        scheduler.leave(slot)


# -- priming: batched, fair, shared ---------------------------------------------------------


def _same(a, b, atol: float = 0.0) -> bool:
    """Saved states (nested tuples and lists of tensors and numbers) equal: integers
    exactly, floats within `atol` (0: bit for bit)."""
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():
            return a.shape == b.shape and bool((a.cpu() - b.cpu()).abs().max() <= atol)
        return torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y, atol) for x, y in zip(a, b))
    return a == b


# A CPU matrix product of several rows rounds differently from one of a single row (another
# kernel): a persona primed beside others is its one-row self within this, and its stream's
# tokens after it are the same (as a stream in a batch is itself alone: PCM within 1e-4).
BATCH_ROUNDING = 1e-5


def _primed_alone(model, persona_tokens):
    """The persona primed by itself on a one-row generator -> (its saved state, frames
    that ran)."""
    from personaplex_cli.core import priming
    from personaplex_cli.core.graphs import make_generator

    gen = make_generator(model.lm, 1, graphs=False)
    priming.prime(gen, persona_tokens)
    return gen.save(0), int(gen.offsets[0]) - 1


def test_personas_primed_side_by_side_equal_each_primed_alone(golden_model, personas):
    """Four newcomers of four personas (a .pt voice, a recording, none) prime in the same
    primer steps, and each primed state equals the persona primed alone (its integers
    exactly, its floats within the batch's rounding), its stream after it the same."""
    pcm = callers(16, 4, seed=6)
    slots = Scheduler.for_model(golden_model, 4)
    rows = [slots.begin(personas[i], SAMPLED, 30 + i) for i in range(4)]
    longest = max(p.frames for p in personas)
    assert sorted(slots.prime(longest)) == rows  # all at once: the primer is a batch
    assert slots.primer_steps <= longest  # one at a time: the sum, 191
    for i, slot in enumerate(rows):
        tokens = personas[i].persona_tokens(golden_model)
        cached = slots.priming._cache[personas[i].key]
        saved, runs = _primed_alone(golden_model, tokens)
        assert cached.runs == runs
        assert _same(cached.saved, saved, BATCH_ROUNDING)
    steps = [slots.step(pcm[t]) for t in range(16)]
    for i, slot in enumerate(rows):
        tokens = np.stack([f.tokens[slot] for f in steps])
        assert np.array_equal(tokens, alone(golden_model, personas[i], SAMPLED, 30 + i,
                                            pcm[:, slot])[0])


def test_a_cached_newcomer_is_not_held_by_a_long_priming(golden_model, personas):
    slots = Scheduler.for_model(golden_model, 3)
    slots.join(personas[2], GREEDY, 0)  # its persona is now cached
    long = slots.begin(personas[1], GREEDY, 1)
    slots.prime(2)  # the long priming is under way
    newcomer = slots.begin(personas[2], SAMPLED, 2)
    assert slots.prime(1) == [newcomer]  # at once, whatever is priming
    assert long not in slots.live()


def _persona_prompt(tokens, key):
    """A persona whose tokens are `tokens` (core.priming.PersonaTokens), cached as `key`."""
    from personaplex_cli.prompts.persona import PersonaPrompt

    prompt = PersonaPrompt(list(tokens.text_tokens), key=key)
    prompt._tokens = tokens
    return prompt


def test_priming_takes_turns_so_a_long_prompt_delays_only_its_own_stream(golden_model):
    """Five personas waiting on a primer of four rows: four long role prompts first, a
    short one last. The short one goes live within about its own steps' worth of turns;
    the long ones still each equal themselves primed alone (their rows taken turns)."""
    from personaplex_cli.core.config import PRIMER_ROWS
    from personaplex_cli.core.priming import PersonaTokens
    assert PRIMER_ROWS == 4
    slots = Scheduler.for_model(golden_model, 6, graphs=False)
    longs = [PersonaTokens(tuple(range(100 + 60 * i, 160 + 60 * i))) for i in range(4)]
    short = PersonaTokens((40, 41, 42))
    for i, persona in enumerate(longs):
        slots.begin(_persona_prompt(persona, ("long", i)), GREEDY, i)
    newcomer = slots.begin(_persona_prompt(short, "short"), GREEDY, 9)
    steps, live = 0, []
    while newcomer not in live:
        live = slots.prime(4)
        steps += 4
        assert not set(live) - {newcomer}
    # Alone, it needs short.steps; sharing the primer with four others, at most twice that
    # and a turn (first come, first served, it waited for 4 x 72 steps).
    assert steps <= 2 * short.steps + 8
    while slots.pending_frames():
        slots.prime(5)
    for i, persona in enumerate(longs):
        saved, runs = _primed_alone(golden_model, persona)
        assert slots.priming._cache[("long", i)].runs == runs
        assert _same(slots.priming._cache[("long", i)].saved, saved, BATCH_ROUNDING)


def test_a_persona_primed_alone_is_the_one_row_primers_bit_for_bit(golden_model, personas):
    """Alone in the primer, a persona steps its row alone (eager): the state the one-row
    primer left before, so a reply's bytes, primed one persona at a time, stay the same."""
    slots = Scheduler.for_model(golden_model, 4)
    for i in (0, 1):
        slots.join(personas[i], GREEDY, i)
        saved, runs = _primed_alone(golden_model, personas[i].persona_tokens(golden_model))
        assert _same(slots.priming._cache[personas[i].key].saved, saved)


def test_joins_of_one_persona_waiting_together_share_one_priming(golden_model, personas):
    pcm = callers(12, 2, seed=7)
    slots = Scheduler.for_model(golden_model, 2)
    rows = [slots.begin(personas[1], SAMPLED, 40 + i) for i in range(2)]
    assert slots.pending_frames() == personas[1].frames  # once, not twice
    assert sorted(slots.prime(slots.pending_frames())) == rows
    assert slots.primer_steps == personas[1].frames - 1  # frame 0 runs no model
    steps = [slots.step(pcm[t]) for t in range(12)]
    for i, slot in enumerate(rows):
        tokens = np.stack([f.tokens[slot] for f in steps])
        assert np.array_equal(tokens, alone(golden_model, personas[1], SAMPLED, 40 + i,
                                            pcm[:, slot])[0])


def test_a_join_that_leaves_while_priming_frees_its_primer_row(golden_model, personas):
    slots = Scheduler.for_model(golden_model, 2)
    a = slots.begin(personas[1], GREEDY, 0)
    b = slots.begin(personas[1], GREEDY, 1)  # shares a's priming
    slots.prime(3)
    slots.leave(a)
    assert slots.pending_frames() > 0  # b still waits for it
    slots.leave(b)
    assert slots.pending_frames() == 0 and slots.priming.primer.free_rows() == [0, 1]
    c = slots.begin(personas[2], GREEDY, 2)
    assert slots.prime(slots.pending_frames()) == [c]


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
