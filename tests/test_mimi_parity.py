"""Mimi against Kyutai's reference (moshi 0.2.13) and NVIDIA's golden outputs.

The reference models are random-weight Mimis built by the reference itself, saved in the
published key layout (fused attention keys) and loaded by our loader, so the key mapping is
under test too. These tests never skip: a missing reference is a failure.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import reference
from personaplex_cli.core.config import arch_from_dict
from personaplex_cli.core.mimi import Mimi
from personaplex_cli.core.weights import WeightsError, load_strict, mimi_key
from personaplex_cli.model.load import load_mimi_from_dir, read_safetensors

GOLDEN = Path(__file__).parent / "data" / "golden"
FRAME = 1920

torch.set_grad_enabled(False)


def frames_of(pcm: torch.Tensor) -> list[torch.Tensor]:
    return [pcm[..., i:i + FRAME] for i in range(0, pcm.shape[-1], FRAME)]


def reference_stream_encode(ref, pcm: torch.Tensor) -> torch.Tensor:
    with ref.streaming(pcm.shape[0]):
        return torch.cat([ref.encode(f) for f in frames_of(pcm)], dim=-1)


def reference_stream_decode(ref, codes: torch.Tensor) -> torch.Tensor:
    with ref.streaming(codes.shape[0]):
        return torch.cat([ref.decode(codes[..., i:i + 1]) for i in range(codes.shape[-1])], -1)


def our_stream_encode(mimi: Mimi, pcm: torch.Tensor, chunk: int = 1, **kw) -> torch.Tensor:
    state = mimi.encoder_state(pcm.shape[0], max_frames=chunk, **kw)
    step = chunk * FRAME
    return torch.cat([mimi.encode(pcm[..., i:i + step], state)
                      for i in range(0, pcm.shape[-1], step)], dim=-1)


def our_stream_decode(mimi: Mimi, codes: torch.Tensor, chunk: int = 1, **kw) -> torch.Tensor:
    state = mimi.decoder_state(codes.shape[0], max_frames=chunk, **kw)
    return torch.cat([mimi.decode(codes[..., i:i + chunk], state)
                      for i in range(0, codes.shape[-1], chunk)], dim=-1)


def speechlike(frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * FRAME) / 24000
    tone = sum(torch.sin(2 * torch.pi * f * t) for f in (140.0, 290.0, 1100.0)) / 3
    envelope = 0.5 + 0.5 * torch.sin(2 * torch.pi * 3 * t)
    noise = 0.05 * torch.randn(batch, 1, frames * FRAME, generator=gen)
    return (0.3 * tone * envelope + noise).float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny Mimi with a transformer context of 8 steps, so the KV ring wraps after 4 frames."""
    folder = tmp_path_factory.mktemp("tiny_mimi")
    ref = reference.build_mimi(folder, reference.TINY_MIMI, seed=11)
    ours, _ = load_mimi_from_dir(folder, torch.device("cpu"))
    return ref, ours, folder


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The default (released) Mimi architecture with random weights."""
    folder = tmp_path_factory.mktemp("full_mimi")
    ref = reference.build_mimi(folder, None, seed=12)
    ours, _ = load_mimi_from_dir(folder, torch.device("cpu"))
    return ref, ours


def test_both_key_layouts_load_to_identical_tensors(tiny, tmp_path):
    ref, ours, folder = tiny
    module_dir = tmp_path / "module_layout"
    reference.build_mimi(module_dir, reference.TINY_MIMI, seed=11, layout="module")
    published = read_safetensors(folder / "tokenizer-e351c8d8-checkpoint125.safetensors")
    module = read_safetensors(module_dir / "tokenizer-e351c8d8-checkpoint125.safetensors")
    assert any("in_proj_weight" in k for k in published)
    assert any("in_projs.0.weight" in k for k in module)
    ours_module, _ = load_mimi_from_dir(module_dir, torch.device("cpu"))
    for (name, a), (_, b) in zip(ours.state_dict().items(), ours_module.state_dict().items()):
        assert torch.equal(a, b), name


def test_loading_is_strict(tiny):
    _, ours, folder = tiny
    tensors = read_safetensors(folder / "tokenizer-e351c8d8-checkpoint125.safetensors")
    arch = arch_from_dict(json.loads((folder / "personaplex-arch.json").read_text()))
    missing = dict(tensors)
    missing.pop(next(k for k in missing if k.endswith("_initialized")))
    with pytest.raises(WeightsError, match="missing"):
        load_strict(Mimi(arch.mimi), missing, mimi_key)
    extra = dict(tensors, **{"encoder.model.0.conv.conv.extra": torch.zeros(1)})
    with pytest.raises(WeightsError, match="unexpected"):
        load_strict(Mimi(arch.mimi), extra, mimi_key)
    key = "decoder.model.0.conv.conv.weight"
    wrong = dict(tensors, **{key: torch.zeros(3, 3, 3)})
    with pytest.raises(WeightsError, match="shape"):
        load_strict(Mimi(arch.mimi), wrong, mimi_key)


@pytest.mark.parametrize("model", ["tiny", "full"])
def test_whole_encode_and_decode_match_reference(model, request):
    ref, ours = request.getfixturevalue(model)[:2]
    pcm = speechlike(12, seed=1, batch=2)[..., :-700]  # not a whole number of frames
    codes = ref.encode(pcm)
    assert torch.equal(ours.encode(pcm), codes)
    assert (ref.decode(codes) - ours.decode(codes)).abs().max() <= 1e-4


@pytest.mark.parametrize("model,frames", [("tiny", 30), ("full", 140)])
def test_streaming_matches_reference_past_the_context(model, frames, request):
    """Frame by frame, past the transformer's context, where 0.2.13's ring drops keys early."""
    ref, ours = request.getfixturevalue(model)[:2]
    pcm = speechlike(frames, seed=2)
    with ref.streaming(1):
        ref_latent = torch.cat([ref._encode_to_unquantized_latent(f) for f in frames_of(pcm)], -1)
    whole_latent = ref._encode_to_unquantized_latent(pcm)
    assert (ref_latent - whole_latent).abs().max() > 1e-3, "the run must reach the ring rule"
    state = ours.encoder_state(1)
    our_latent = torch.cat([ours.encode_latent(f, state) for f in frames_of(pcm)], dim=-1)
    assert (our_latent - ref_latent).abs().max() <= 1e-4
    # The reference's streamed codes, without a second streamed pass: its encode() is its
    # quantizer over this latent, frame by frame, and the quantizer holds no state.
    codes = ref.quantizer.encode(ref_latent)
    assert torch.equal(our_stream_encode(ours, pcm), codes)
    expected = reference_stream_decode(ref, codes)
    assert (our_stream_decode(ours, codes) - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("chunk", [2, 5, 7])
def test_multi_frame_calls_equal_frame_by_frame_reference(tiny, chunk):
    ref, ours, _ = tiny
    pcm = speechlike(21, seed=3)
    codes = reference_stream_encode(ref, pcm)
    assert torch.equal(our_stream_encode(ours, pcm, chunk=chunk), codes)
    expected = reference_stream_decode(ref, codes)
    assert (our_stream_decode(ours, codes, chunk=chunk) - expected).abs().max() <= 1e-4


def test_whole_equals_streaming_until_the_ring_fills(full):
    """The reference's own claim: identical for the first 10 s (125 frames at context 250)."""
    _, ours = full
    pcm = speechlike(125, seed=4)
    assert torch.equal(our_stream_encode(ours, pcm), ours.encode(pcm))
    codes = ours.encode(pcm)
    assert (our_stream_decode(ours, codes) - ours.decode(codes)).abs().max() <= 1e-4


def test_all_32_codebooks(tiny):
    ref, ours, _ = tiny
    pcm = speechlike(6, seed=5)
    ref.set_num_codebooks(32)
    try:
        codes = ref.encode(pcm)
    finally:
        ref.set_num_codebooks(8)
    ours.set_num_codebooks(32)
    try:
        assert torch.equal(ours.encode(pcm), codes)
    finally:
        ours.set_num_codebooks(8)
    assert (ref.decode(codes) - ours.decode(codes)).abs().max() <= 1e-4


def test_reset_equals_a_fresh_state(tiny):
    _, ours, _ = tiny
    pcm = speechlike(10, seed=6)
    state = ours.encoder_state(1)
    for frame in frames_of(speechlike(5, seed=7)):
        ours.encode(frame, state)
    state.reset()
    again = torch.cat([ours.encode(f, state) for f in frames_of(pcm)], dim=-1)
    assert torch.equal(again, our_stream_encode(ours, pcm))


@pytest.fixture(scope="module")
def golden_mimi():
    def load(arch_file: str) -> Mimi:
        arch = arch_from_dict(json.loads((GOLDEN / "assets" / arch_file).read_text()))
        mimi = Mimi(arch.mimi)
        tensors = read_safetensors(GOLDEN / "assets" / "tokenizer-tiny-mimi.safetensors")
        load_strict(mimi, tensors, mimi_key)
        return mimi.eval().prepare()
    return load


@pytest.mark.parametrize("case,arch_file,window", [
    ("fp32_wav_greedy", "personaplex-arch.json", "nvidia"),
    ("fp32_wav_greedy_bigctx", "personaplex-arch-bigctx.json", "nvidia"),
    ("fp32_wav_greedy_bigctx", "personaplex-arch-bigctx.json", "kyutai"),
])
def test_nvidia_golden_streaming_codec(golden_mimi, case, arch_file, window):
    """NVIDIA's fork drops the oldest KV slot one step early (golden README, ring quirk)."""
    mimi = golden_mimi(arch_file)
    pcm = torch.from_numpy(np.load(GOLDEN / "assets" / "input_pcm.npy"))[None]
    pcm = torch.nn.functional.pad(pcm, (0, -pcm.shape[-1] % FRAME))
    want = np.load(GOLDEN / case / "user_codes.npy")
    assert np.array_equal(our_stream_encode(mimi, pcm, window=window)[0].numpy(), want)

    prompt = torch.from_numpy(np.load(GOLDEN / "assets" / "voice_prompt_normalized.npy"))
    prompt = torch.nn.functional.pad(prompt.float()[None], (0, -prompt.shape[-1] % FRAME))
    want = np.load(GOLDEN / case / "voice_prompt_codes.npy")
    assert np.array_equal(our_stream_encode(mimi, prompt, window=window)[0].numpy(), want)

    tokens = torch.from_numpy(np.load(GOLDEN / case / "tokens.npy"))
    expected = np.load(GOLDEN / case / "output_pcm.npy")
    pcm_out = our_stream_decode(mimi, tokens[None, 1:9], window=window)[0, 0].numpy()
    assert np.abs(pcm_out[:len(expected)] - expected).max() <= 1e-4


def test_window_rules_differ_once_the_ring_is_full(golden_mimi):
    """Kyutai's rule cannot reproduce the small-context golden case: the parameter matters."""
    mimi = golden_mimi("personaplex-arch.json")
    pcm = torch.from_numpy(np.load(GOLDEN / "assets" / "input_pcm.npy"))[None]
    pcm = torch.nn.functional.pad(pcm, (0, -pcm.shape[-1] % FRAME))
    want = np.load(GOLDEN / "fp32_wav_greedy" / "user_codes.npy")
    kyutai = our_stream_encode(mimi, pcm, window="kyutai")[0].numpy()
    assert not np.array_equal(kyutai, want)
    assert np.array_equal(kyutai[:, :10], want[:, :10])  # same until the 40-step ring fills


def test_mimi_computes_its_fp32_without_tf32_and_leaves_the_flags_as_they_were(monkeypatch):
    """cuDNN convolutions default to TF32 on CUDA, which would make a GPU's codes differ
    from the CPU's: Mimi turns TF32 off (cuDNN and cuBLAS) for its own work, encode and
    decode, and puts both flags back afterwards."""
    from personaplex_cli.doctor.bench import bench_arch, random_mimi

    mimi = random_mimi(bench_arch("tiny"), torch.device("cpu"), seed=0)
    backends = torch.backends
    flags = backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
    backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = True
    seen = []
    for part in (mimi.encoder, mimi.decoder):
        run = part.forward

        def watched(*args, run=run, **kwargs):
            seen.append((backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32))
            return run(*args, **kwargs)

        monkeypatch.setattr(part, "forward", watched)
    try:
        codes = mimi.encode(torch.zeros(1, 1, 1920))
        mimi.decode(codes)
        after = backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
    finally:
        backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = flags
    assert seen == [(False, False), (False, False)]
    assert after == (True, True)
