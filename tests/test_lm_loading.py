"""Loading the LM: strict, shape-checked, either key layout, only the depformer steps used."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import reference
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.load import ModelFileError, default_dtype, load_lm


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm")
    reference.build_lm(folder, reference.tiny_lm_kwargs(), seed=3)
    return folder


def copy_with(tmp_path, source, tensors=None, arch=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors if tensors is not None else load_file(source / "model.safetensors"),
              str(tmp_path / "model.safetensors"))
    arch = arch if arch is not None else json.loads((source / "personaplex-arch.json").read_text())
    (tmp_path / "personaplex-arch.json").write_text(json.dumps(arch))
    return ModelDir(tmp_path, "test")


def test_unused_depformer_steps_are_never_loaded(checkpoint):
    full = load_lm(ModelDir(checkpoint, "t"), torch.device("cpu"), torch.float32, dep_steps=16)
    eight = load_lm(ModelDir(checkpoint, "t"), torch.device("cpu"), torch.float32)
    assert full.dep_steps == 16 and eight.dep_steps == 8  # 8 by default
    assert len(eight.linears) == 8 and len(eight.depformer.layers[0].gating) == 8
    assert len(eight.depformer.layers[0].self_attn.in_projs) == 8
    for key, tensor in eight.state_dict().items():
        assert torch.equal(tensor, full.state_dict()[key]), key


def test_default_precision():
    from personaplex_cli.model.device import cpu_computes_bf16

    native = torch.bfloat16 if cpu_computes_bf16() else torch.float32
    assert default_dtype(torch.device("cpu")) == native
    assert default_dtype(torch.device("cuda")) == torch.bfloat16


def test_dtype_cast(checkpoint):
    lm = load_lm(ModelDir(checkpoint, "t"), torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in lm.parameters())


def test_wide_linears_are_stored_input_major_on_the_cpu_in_fp32(checkpoint):
    """On the CPU in fp32 the linears wider out than in hold W.T contiguous, the rest stay
    nn.Linear, and each gives nn.Linear's product to rounding; bf16 keeps every nn.Linear."""
    from torch import nn

    from personaplex_cli.core.layers import InputMajorLinear

    lm = load_lm(ModelDir(checkpoint, "t"), torch.device("cpu"), torch.float32)
    wide = {name: m for name, m in lm.named_modules() if isinstance(m, InputMajorLinear)}
    narrow = [m for m in lm.modules() if isinstance(m, nn.Linear)]
    assert "text_linear" in wide and "linears.0" in wide and narrow
    assert all(m.out_features <= m.in_features for m in narrow)
    rng = torch.Generator().manual_seed(0)
    for name, module in wide.items():
        assert module.weight_t.is_contiguous()
        assert module.weight.shape == (module.out_features, module.in_features)
        for batch in (1, 3):
            x = torch.randn(batch, 1, module.in_features, generator=rng)
            want = torch.nn.functional.linear(x, module.weight)
            assert (module(x) - want).abs().max() <= 1e-5, name
    plain = load_lm(ModelDir(checkpoint, "t"), torch.device("cpu"), torch.bfloat16)
    assert not any(isinstance(m, InputMajorLinear) for m in plain.modules())


def test_moshiko_shaped_checkpoint_is_recognised(tmp_path):
    """8 depformer steps and no architecture entry for dep_q: the file says how many."""
    kwargs = reference.tiny_lm_kwargs(dep_q=8)
    reference.build_lm(tmp_path / "src", kwargs, seed=4)
    arch = {"lm": {k: v for k, v in kwargs.items() if k != "dep_q"}}
    model = copy_with(tmp_path / "m", tmp_path / "src", arch=arch)
    lm = load_lm(model, torch.device("cpu"), torch.float32)
    assert lm.dep_q == 8 and len(lm.linears) == 8


@pytest.mark.parametrize("damage,message", [
    ("drop", "missing"),
    ("extra", "unexpected"),
    ("shape", "shape"),
    ("depformer_rows", "split"),
])
def test_strict_errors(checkpoint, tmp_path, damage, message):
    tensors = load_file(checkpoint / "model.safetensors")
    if damage == "drop":
        tensors.pop("out_norm.alpha")
    elif damage == "extra":
        tensors["surprise.weight"] = torch.zeros(2)
    elif damage == "shape":
        tensors["text_linear.weight"] = torch.zeros(7, 64)
    else:
        key = "depformer.layers.0.self_attn.in_proj_weight"
        tensors[key] = tensors[key][:-1]
    model = copy_with(tmp_path, checkpoint, tensors)
    with pytest.raises(ModelFileError, match=message):
        load_lm(model, torch.device("cpu"), torch.float32)


def test_not_a_checkpoint(checkpoint, tmp_path):
    model = copy_with(tmp_path, checkpoint)
    (tmp_path / "model.safetensors").write_bytes(b"definitely not safetensors")
    with pytest.raises(ModelFileError, match="cannot read"):
        load_lm(model, torch.device("cpu"), torch.float32)


def test_unsupported_architecture(checkpoint, tmp_path):
    arch = json.loads((checkpoint / "personaplex-arch.json").read_text())
    arch["lm"]["gating"] = "gelu"
    model = copy_with(tmp_path, checkpoint, arch=arch)
    with pytest.raises(ModelFileError, match="gating"):
        load_lm(model, torch.device("cpu"), torch.float32)


def test_a_load_builds_its_modules_without_initialising_them(checkpoint):
    """The modules built before their tensors are read (on the meta device) skip torch's
    initialisers: a meta `normal_` imports torch._dynamo on first use, over a second of
    every load on a small machine. In a fresh interpreter, loading the LM and counting its
    memory leave torch._dynamo unimported, and the loaded weights are the checkpoint's."""
    import subprocess
    import sys

    script = f"""
import sys, torch
from safetensors.torch import load_file
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.load import load_lm, read_arch
from personaplex_cli.model.memory import lm_weight_bytes
from pathlib import Path
folder = ModelDir(Path({str(checkpoint)!r}), "test")
lm = load_lm(folder, torch.device("cpu"), torch.float32)
assert lm_weight_bytes(read_arch(folder).lm, lm.dep_steps, torch.float32, "none") > 0
saved = load_file({str(checkpoint / "model.safetensors")!r})
emb = lm.emb[0].weight
assert emb.device.type == "cpu" and torch.equal(emb, saved["emb.0.weight"].float())
print("torch._dynamo" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_shapes_only_builds_on_meta_and_leaves_nothing_behind():
    from torch import nn

    from personaplex_cli.model.skeleton import shapes_only

    with shapes_only():
        layers = [nn.Linear(4, 3), nn.Embedding(5, 2), nn.LayerNorm(3)]
    assert all(p.device.type == "meta" for layer in layers for p in layer.parameters())
    assert torch.ones(1).device.type == "cpu"
    assert nn.Linear(4, 3).weight.abs().sum() > 0  # initialised again outside
