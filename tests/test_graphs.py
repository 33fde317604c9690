"""CUDA graphs replay exactly what the eager code computes. Needs CUDA: skipped without it
(the only test allowed to skip); the CPU tests cover the eager path it is compared with."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_cli.core.generator import FrameGenerator
from personaplex_cli.core.graphs import GraphedFrameGenerator, make_generator
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.core.session import Session
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.load import load_lm, load_mimi

ASSETS = Path(__file__).parent / "data" / "golden" / "assets"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graphs")
    for file in ("model.safetensors", "tokenizer-tiny-mimi.safetensors"):
        (folder / file).symlink_to(ASSETS / file)
    shutil.copy(ASSETS / "personaplex-arch.json", folder / "personaplex-arch.json")
    return ModelDir(folder, "golden")


def test_cpu_generators_are_eager(model_dir):
    lm = load_lm(model_dir, torch.device("cpu"), torch.float32)
    assert type(make_generator(lm)) is FrameGenerator
    with pytest.raises(ValueError, match="CUDA"):
        GraphedFrameGenerator(lm)


def _conversation(session: Session, frames: int) -> torch.Tensor:
    session.prime(text_tokens=[5, 9, 6, 10, 286, 109])
    pcm = torch.from_numpy(np.load(ASSETS / "input_pcm.npy"))[0, :frames * 1920]
    outputs = []
    for t in range(frames):
        audio, tokens = session.step(pcm[t * 1920:(t + 1) * 1920])
        outputs.append(torch.cat([audio.float(), tokens.float()]).cpu())
    return torch.stack(outputs)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(model_dir, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    lm = load_lm(model_dir, device, dtype, dep_steps=8)
    mimi, _ = load_mimi(model_dir, device)
    runs = []
    for graphs in (False, True):
        rng = torch.Generator(device).manual_seed(1234)
        session = Session(mimi, lm, Sampling(), generator=rng, graphs=graphs)
        runs.append(_conversation(session, frames=30))
    assert torch.equal(runs[0], runs[1])
