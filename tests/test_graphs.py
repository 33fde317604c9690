"""CUDA graphs replay exactly what the eager code computes. Needs CUDA: skipped without it
(the only test allowed to skip); the CPU tests cover the eager path it is compared with."""

from __future__ import annotations

import shutil
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_cli.core.generator import FrameGenerator
from personaplex_cli.core.graphs import GraphedFrameGenerator, make_generator, use_graphs
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.load import load_lm, load_mimi
from personaplex_cli.prompts.persona import PersonaPrompt
from personaplex_cli.runtime.scheduler import Scheduler

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
    assert not use_graphs(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA"):
        GraphedFrameGenerator(lm)
    with pytest.raises(ValueError, match="CUDA"):
        use_graphs(torch.device("cpu"), True)


def _conversation(slots: Scheduler, frames: int) -> torch.Tensor:
    """Two streams, the second joining at frame 10 with other sampling, the first leaving
    at frame 20 and a third taking its row: every row's output, frame by frame."""
    device = slots.session.device
    persona = PersonaPrompt([5, 9, 6, 10, 286, 109], key="p")
    rng = lambda seed: torch.Generator(device).manual_seed(seed).get_state()  # noqa: E731
    first = slots.join(persona, Sampling(), rng(1234))
    pcm = np.load(ASSETS / "input_pcm.npy")[0, :frames * 1920]
    outputs = []
    for t in range(frames):
        if t == 10:
            slots.join(persona, Sampling(top_k_text=5, temp_audio=0.6), rng(99))
        if t == 20:
            slots.leave(first)
            slots.join(PersonaPrompt([7, 8]), Sampling(greedy=True), rng(5))
        frame = np.broadcast_to(pcm[t * 1920:(t + 1) * 1920], (slots.capacity, 1920))
        out = slots.step(frame)
        outputs.append(torch.cat([torch.from_numpy(out.pcm), torch.from_numpy(out.tokens)
                                  .float()], dim=1))
    return torch.stack(outputs)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(model_dir, dtype):
    """Rows joining and leaving a captured batch: the graphs are never captured again and
    replay exactly what the eager code computes."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    lm = load_lm(model_dir, device, dtype, dep_steps=8)
    mimi, _ = load_mimi(model_dir, device)
    runs = []
    for graphs in (False, True):
        slots = Scheduler.for_model(SimpleNamespace(mimi=mimi, lm=lm), 3, graphs=graphs)
        captured = vars(slots.session.gen).get("_sample_graph")
        runs.append(_conversation(slots, frames=30))
        assert vars(slots.session.gen).get("_sample_graph") is captured
    assert torch.equal(runs[0], runs[1])
