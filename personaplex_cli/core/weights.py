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
    (re.compile(r"\.self_attn\.in_proj_weight$"), ".self_attn.in_projs.0.weight"),
    (re.compile(r"\.self_attn\.out_proj\.weight$"), ".self_attn.out_projs.0.weight"),
    (re.compile(r"\.inited$"), "._initialized"),
    (re.compile(r"\.cluster_size$"), ".cluster_usage"),
    (re.compile(r"\.embed_(avg|sum)$"), ".embedding_sum"),
]


def mimi_key(key: str) -> str:
    """Reference Mimi key (either layout) -> our module's key."""
    for pattern, replacement in _MIMI_RULES:
        key = pattern.sub(replacement, key)
    return key


def check_strict(expected: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]],
                 what: str) -> None:
    """Requires exactly the expected keys, each with the expected shape."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        raise WeightsError(f"{what} does not match the architecture: " + ", ".join(parts))
    for key, shape in given.items():
        if tuple(shape) != tuple(expected[key]):
            raise WeightsError(f"{what}: {key} has shape {tuple(shape)}, "
                               f"expected {tuple(expected[key])}")


def load_strict(module: nn.Module, tensors: dict[str, torch.Tensor],
                rename=lambda key: key, what: str = "checkpoint") -> None:
    """Puts `tensors` into `module` (which may live on the meta device), requiring exactly
    its keys and shapes; the tensors themselves become the parameters (no second copy)."""
    expected = module.state_dict()
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        ours = rename(key)
        if ours in renamed:
            raise WeightsError(f"{what}: {key!r} appears twice (in both key layouts?)")
        renamed[ours] = tensor
    check_strict({k: tuple(v.shape) for k, v in expected.items()},
                 {k: tuple(v.shape) for k, v in renamed.items()}, what)
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in renamed.items()},
                           strict=True, assign=True)


# One tensor of ours <- rows [index * n, (index + 1) * n) of a checkpoint tensor split in
# `parts` equal parts (the depformer's per-step attention weights are fused step-major).
LMSource = tuple[str, int, int]  # (checkpoint key, index, parts)


def lm_sources(shapes: dict[str, tuple[int, ...]], dep_q: int
               ) -> tuple[dict[str, LMSource], dict[str, tuple[int, ...]]]:
    """Checkpoint LM keys (either layout) -> (our key -> source, our key -> shape)."""
    sources: dict[str, LMSource] = {}
    our_shapes: dict[str, tuple[int, ...]] = {}

    def add(ours: str, key: str, index: int = 0, parts: int = 1) -> None:
        if ours in sources:
            raise WeightsError(f"LM checkpoint: {key!r} given twice (in both key layouts?)")
        shape = tuple(shapes[key])
        if parts > 1:
            if shape[0] % parts:
                raise WeightsError(f"LM checkpoint: {key} has shape {shape}, whose rows do "
                                   f"not split into {parts} depformer steps")
            shape = (shape[0] // parts,) + shape[1:]
        sources[ours] = (key, index, parts)
        our_shapes[ours] = shape

    for key in shapes:
        match = re.match(r"^(.*\.self_attn\.)(in_proj_weight|out_proj\.weight)$", key)
        if match and key.startswith("depformer."):
            name = "in_projs" if match.group(2) == "in_proj_weight" else "out_projs"
            for step in range(dep_q):
                add(f"{match.group(1)}{name}.{step}.weight", key, step, dep_q)
        elif match:
            name = "in_projs" if match.group(2) == "in_proj_weight" else "out_projs"
            add(f"{match.group(1)}{name}.0.weight", key)
        else:
            add(key, key)
    return sources, our_shapes
