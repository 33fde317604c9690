"""Checkpoint key layouts -> our module names, and strict, shape-checked loading.

Two layouts exist for the same weights (reference-moshi.md section 2):
  published  what the released safetensors hold: fused `self_attn.in_proj_weight` and
             `self_attn.out_proj.weight`, plus older codebook names in some files;
  module     moshi 0.2.13's own `state_dict()`: `self_attn.in_projs.0.weight`, `out_projs.0`.
Both carry the reference's wrapper modules (`conv.conv`, `convtr.convtr`, `transformer.`,
`vq.layers.N._codebook`), which our modules do without.
"""

from __future__ import annotations

import re

import torch
from torch import nn


class WeightsError(ValueError):
    """The checkpoint does not match the architecture."""


_MIMI_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^downsample\.conv\.conv\.conv\."), "downsample."),
    (re.compile(r"^upsample\.convtr\.convtr\.convtr\."), "upsample."),
    (re.compile(r"\.conv\.conv\."), "."),
    (re.compile(r"\.convtr\.convtr\."), "."),
    (re.compile(r"_transformer\.transformer\."), "_transformer."),
    (re.compile(r"\.vq\.layers\.(\d+)\._codebook\."), r".codebooks.\1."),
    (re.compile(r"\.self_attn\.in_proj_weight$"), ".self_attn.in_proj.weight"),
    (re.compile(r"\.self_attn\.in_projs\.0\.weight$"), ".self_attn.in_proj.weight"),
    (re.compile(r"\.self_attn\.out_projs\.0\.weight$"), ".self_attn.out_proj.weight"),
    (re.compile(r"\.inited$"), "._initialized"),
    (re.compile(r"\.cluster_size$"), ".cluster_usage"),
    (re.compile(r"\.embed_(avg|sum)$"), ".embedding_sum"),
]


def mimi_key(key: str) -> str:
    """Reference Mimi key (either layout) -> our module's key."""
    for pattern, replacement in _MIMI_RULES:
        key = pattern.sub(replacement, key)
    return key


def load_strict(module: nn.Module, tensors: dict[str, torch.Tensor],
                rename=lambda key: key, what: str = "checkpoint") -> None:
    """Copies `tensors` into `module`, requiring exactly its keys and shapes."""
    expected = module.state_dict()
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        ours = rename(key)
        if ours in renamed:
            raise WeightsError(f"{what}: {key!r} appears twice (in both key layouts?)")
        renamed[ours] = tensor
    missing = sorted(set(expected) - set(renamed))
    unexpected = sorted(set(renamed) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        raise WeightsError(f"{what} does not match the architecture: " + ", ".join(parts))
    for key, tensor in renamed.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise WeightsError(f"{what}: {key} has shape {tuple(tensor.shape)}, "
                               f"expected {tuple(expected[key].shape)}")
    with torch.no_grad():
        for key, target in expected.items():
            target.copy_(renamed[key].to(target.dtype))
