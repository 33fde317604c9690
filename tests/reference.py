"""Builds random-weight models with Kyutai's reference (moshi 0.2.13) for parity tests.

The reference is a test-only oracle: the package under test never imports it.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # read by moshi at import time

import torch
from safetensors.torch import save_file

from moshi.models import loaders  # noqa: E402

TINY_MIMI = {
    "seanet": {"dimension": 32, "n_filters": 4},
    "transformer": {"d_model": 32, "num_heads": 4, "num_layers": 2, "dim_feedforward": 64,
                    "context": 8, "input_dimension": 32, "output_dimensions": [32]},
    "quantizer": {"dimension": 16, "input_dimension": 32, "output_dimension": 32},
}


def mimi_config(overrides: dict | None) -> dict:
    config = copy.deepcopy(loaders._mimi_config)
    for group, values in (overrides or {}).items():
        config[group].update(values)
    return config


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of realistic scale; the reference's own init leaves codebooks empty."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor is None or not tensor.is_floating_point():
            continue
        shape = tensor.shape
        if name.endswith("embedding_sum"):
            value = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("cluster_usage"):
            value = 0.5 + torch.rand(shape, generator=gen)
        elif name.endswith("_initialized"):
            value = torch.ones(shape)
        elif "layer_scale" in name:
            value = 0.1 + 0.2 * torch.rand(shape, generator=gen)
        elif name.endswith(".bias") and tensor.dim() == 1 and "norm" not in name:
            value = 0.02 * torch.randn(shape, generator=gen)
        elif "norm" in name and name.endswith("weight"):
            value = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif "norm" in name and name.endswith("bias"):
            value = 0.02 * torch.randn(shape, generator=gen)
        elif tensor.dim() >= 2:
            fan_in = tensor[0].numel() if "convtr" not in name else tensor.shape[0] * tensor.shape[2]
            value = torch.randn(shape, generator=gen) / fan_in**0.5
        else:
            value = 0.1 * torch.randn(shape, generator=gen)
        tensor.copy_(value.to(tensor.dtype))
    for module in model.modules():
        if hasattr(module, "_embedding"):
            module._embedding = None  # the reference caches centroids on first use


def published_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """moshi 0.2.13 module keys -> the released files' fused attention keys."""
    out = {}
    for key, tensor in state.items():
        key = key.replace("self_attn.in_projs.0.weight", "self_attn.in_proj_weight")
        key = key.replace("self_attn.out_projs.0.weight", "self_attn.out_proj.weight")
        out[key] = tensor.contiguous()
    return out


def build_mimi(folder: Path, overrides: dict | None = None, seed: int = 0,
               layout: str = "published"):
    """Random reference Mimi, saved in `folder` as a model directory. Returns the model."""
    config = mimi_config(overrides)
    model = loaders.get_mimi(None, config, device="cpu")
    randomize(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items()}
    if layout == "published":
        state = published_layout(state)
    save_file(state, str(folder / "tokenizer-e351c8d8-checkpoint125.safetensors"))
    arch = {"mimi": {g: config[g] for g in ("seanet", "transformer", "quantizer")}}
    arch["mimi"]["num_codebooks"] = 8
    (folder / "personaplex-arch.json").write_text(json.dumps(arch))
    return model


def tiny_lm_kwargs(**overrides) -> dict:
    """A small LMModel config in the reference's keyword names (PersonaPlex structure)."""
    kwargs = copy.deepcopy(loaders._lm_kwargs)
    kwargs.update({
        "dim": 64, "num_heads": 4, "num_layers": 2, "text_card": 300, "context": 3000,
        "depformer_dim": 32, "depformer_num_heads": 4, "depformer_num_layers": 2,
        "depformer_dim_feedforward": 132, "dep_q": 16,
    })
    kwargs.update(overrides)
    return kwargs


@torch.no_grad()
def randomize_lm(model: torch.nn.Module, seed: int) -> None:
    """Embeddings N(0, 1), linears N(0, 1/fan_in) with x4 output heads, norms 1 + 0.1 N."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in model.named_parameters():
        shape = tensor.shape
        if name.endswith("alpha"):
            value = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif "emb" in name:
            value = torch.randn(shape, generator=gen)
        else:
            value = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
            if name.startswith(("text_linear", "linears")):
                value = 4 * value
        tensor.copy_(value.to(tensor.dtype))


def published_lm_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """moshi 0.2.13 module keys -> the released files' fused keys (per-step weights of the
    depformer concatenated step-major)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, tensor in state.items():
        for part, name in (("in_projs", "in_proj_weight"), ("out_projs", "out_proj.weight")):
            marker = f".self_attn.{part}."
            if marker in key:
                prefix, rest = key.split(marker)
                fused.setdefault(f"{prefix}.self_attn.{name}", []).append(
                    (int(rest.split(".")[0]), tensor))
                break
        else:
            out[key] = tensor.contiguous()
    for key, parts in fused.items():
        out[key] = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]).contiguous()
    return out


def build_lm(folder: Path, kwargs: dict, seed: int = 0, layout: str = "published",
             dtype: torch.dtype = torch.float32):
    """Random reference LMModel saved in `folder` as model.safetensors + architecture."""
    model = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=dtype)
    randomize_lm(model, seed)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    state = dict(model.state_dict())
    if layout == "published":
        state = published_lm_layout(state)
    save_file(state, str(folder / "model.safetensors"))
    arch_path = folder / "personaplex-arch.json"
    arch = json.loads(arch_path.read_text()) if arch_path.exists() else {}
    arch["lm"] = {k: v for k, v in kwargs.items()}
    arch_path.write_text(json.dumps(arch))
    return model
