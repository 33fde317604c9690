"""The LM and the generator against Kyutai's reference (moshi 0.2.13) on random tiny LMs.

Kyutai's ring keeps every key of the window (our "kyutai" rule). Configurations cover a
context shorter than the run (the KV ring wraps) and depformers of 16 (PersonaPlex) and 8
(Moshiko-shaped) steps, saved in the published and in the module key layout.
"""

from __future__ import annotations

import pytest
import torch

import reference
from personaplex_cli.core.generator import FrameGenerator
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.load import load_lm

torch.set_grad_enabled(False)

CONFIGS = {
    "personaplex": dict(kwargs=dict(dep_q=16), layout="published"),
    "ring_wraps": dict(kwargs=dict(dep_q=16, context=5), layout="module"),
    "moshiko": dict(kwargs=dict(dep_q=8, context=7, num_layers=3), layout="published"),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    config = CONFIGS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    kwargs = reference.tiny_lm_kwargs(**config["kwargs"])
    ref = reference.build_lm(folder, kwargs, seed=5, layout=config["layout"])
    ours = load_lm(ModelDir(folder, request.param), torch.device("cpu"), torch.float32,
                   dep_steps=kwargs["dep_q"])
    return ref, ours, kwargs


def random_columns(model, steps: int, seed: int) -> torch.Tensor:
    """[steps, 17] valid token columns, with some -1 (absent stream) entries."""
    gen = torch.Generator().manual_seed(seed)
    audio = torch.randint(0, model.card, (steps, model.n_q), generator=gen)
    text = torch.randint(0, model.text_card, (steps, 1), generator=gen)
    columns = torch.cat([text, audio], dim=1)
    columns[0] = torch.tensor(model.initial_tokens())
    columns[3, 5] = -1
    return columns


def test_logits_match_given_the_same_inputs(models):
    ref, ours, _ = models
    steps = 12
    columns = random_columns(ours, steps, seed=1)
    prev = torch.randint(0, ours.card, (steps, ours.dep_q),
                         generator=torch.Generator().manual_seed(2))
    temporal = ours.temporal_state(1, window="kyutai")
    depth = ours.depformer_state(1, window="kyutai")
    with ref.streaming(1):
        for t in range(steps):
            ref_out, ref_text = ref.forward_text(columns[t].view(1, -1, 1))
            out, text = ours.forward_embeddings(ours.embed(columns[t].view(1, -1)), temporal)
            assert (text - ref_text[0, 0]).abs().max() <= 1e-4
            assert (out - ref_out).abs().max() <= 1e-4
            depth.reset()
            with ref.depformer.streaming(1):
                for k in range(ours.dep_q):
                    token = columns[t, :1] if k == 0 else prev[t, k - 1:k]
                    want = ref.forward_depformer(k, token.view(1, 1, 1), ref_out)[0, 0]
                    got = ours.depformer_logits(k, token, out, depth)
                    assert (got - want).abs().max() <= 1e-4


def first_eight_steps(ref, kwargs: dict):
    """A dep_q=8 reference model holding the first 8 depformer steps of `ref`.

    0.2.13's LMGen takes the caller's codes only when dep_q < n_q; the depformer is causal
    over its steps, so the assistant's 8 never depend on the caller's 8 (which are given).
    """
    import re

    from moshi.models import loaders

    if ref.dep_q == 8:
        return ref
    state = {}
    for key, tensor in ref.state_dict().items():
        match = re.search(r"(depformer_in|depformer_emb|linears|gating|in_projs|out_projs)"
                          r"\.(\d+)\.", key)
        limit = 7 if match and match.group(1) == "depformer_emb" else 8
        if match and int(match.group(2)) >= limit:
            continue
        state[key] = tensor
    small = loaders.get_moshi_lm(None, lm_kwargs={**kwargs, "dep_q": 8},
                                 device="cpu", dtype=torch.float32)
    small.load_state_dict(state, strict=True)
    return small.eval()


def test_greedy_generation_matches_lmgen(models):
    """Our (NVIDIA-style) generator against 0.2.13's LMGen, frame for frame.

    0.2.13 runs the model at its very first step, NVIDIA's bookkeeping one call later, so
    our call t returns what the reference's step t-1 returned.
    """
    from moshi.models.lm import LMGen

    ref, ours, kwargs = models
    ref = first_eight_steps(ref, kwargs)
    frames = 14
    user = torch.randint(0, ours.card, (frames + 1, 8),
                         generator=torch.Generator().manual_seed(3))
    ref_gen = LMGen(ref, use_sampling=False)
    ref_out = []
    with ref_gen.streaming(1):
        for t in range(frames):
            out = ref_gen.step(user[t].view(1, -1, 1))
            ref_out.append(None if out is None else out[0, :, 0])
    gen = FrameGenerator(ours, window="kyutai")
    gen.set_sampling(0, Sampling(greedy=True))
    ours_out = []
    for t in range(frames + 1):
        out = gen.step(user=user[t][None])
        ours_out.append(None if out is None else out[0])
    compared = 0
    for t in range(2, frames + 1):
        want = ref_out[t - 1]
        assert want is not None
        assert torch.equal(ours_out[t][:want.shape[0]], want), f"frame {t}"
        compared += 1
    assert compared == frames - 1
