"""From files to ready models: architecture file, safetensors checkpoints, weight identity."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch

from ..core.config import Arch, ArchError, arch_from_dict
from ..core.lm import LMModel
from ..core.mimi import Mimi
from ..core.weights import WeightsError, check_strict, lm_sources, load_strict, mimi_key
from ..errors import ModelInvalidError
from .device import default_dtype
from .files import ModelDir, sha256_file, tool_cache_dir


class ModelFileError(ModelInvalidError):
    """A model file exists but cannot be used (corrupt, wrong shape, bad architecture file)."""


def read_arch(model: ModelDir) -> Arch:
    path = model.arch_file()
    if path is None:
        return Arch()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return arch_from_dict(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFileError(f"cannot read {path}: {error}") from None
    except ArchError as error:
        raise ModelFileError(f"{path}: {error}") from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ModelFileError(f"cannot read checkpoint {path}: {reason}") from None


def weights_sha256(path: Path) -> str:
    """sha256 of a weights file, computed once per (path, size, mtime) and remembered."""
    real = path.resolve()
    # The hub cache already names large-file blobs by their sha256.
    if real.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", real.name):
        return real.name
    stat = real.stat()
    key = f"{real}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = tool_cache_dir() / "sha256.json"
    try:
        index = json.loads(index_path.read_text())
        if isinstance(index, dict) and isinstance(index.get(key), str):
            return index[key]
    except (OSError, ValueError):
        index = {}
    value = sha256_file(real)
    try:
        index = index if isinstance(index, dict) else {}
        index[key] = value
        index_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=index_path.parent, prefix=".sha256.")
        with os.fdopen(fd, "w") as f:
            json.dump(index, f)
        os.replace(tmp, index_path)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return value


def load_mimi(model: ModelDir, device: torch.device) -> tuple[Mimi, str]:
    """Builds Mimi from the model directory -> (model on `device`, sha256 of its weights)."""
    arch = read_arch(model)
    path = model.mimi_file()
    tensors = read_safetensors(path)
    with torch.device("meta"):  # no random init: the checkpoint's tensors become the weights
        mimi = Mimi(arch.mimi)
    try:
        load_strict(mimi, tensors, mimi_key, what=f"Mimi checkpoint {path.name}")
    except WeightsError as error:
        raise ModelFileError(str(error)) from None
    mimi = mimi.prepare().to(device).eval()
    return mimi, weights_sha256(path)


def _lm_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ModelFileError(f"cannot read checkpoint {path}: {reason}") from None


def load_lm(model: ModelDir, device: torch.device, dtype: torch.dtype | None = None,
            dep_steps: int | None = None) -> LMModel:
    """The language model, strictly checked against the architecture, with `dep_steps`
    depformer steps built and nothing else ever placed on `device`.

    By default only the assistant's codebooks' steps (8 of PersonaPlex's 16): the others
    predict the caller's codes, which are always given. Pass dep_q steps for exact reference
    parity of sampled runs (the skipped steps still draw random numbers there).
    """
    from safetensors import safe_open

    dtype = dtype or default_dtype(device)

    arch = read_arch(model)
    path = model.lm_file()
    shapes = _lm_shapes(path)
    lm_arch = dict(arch.lm)
    if "dep_q" not in arch.lm_given:
        # Moshiko-shaped checkpoints carry 8 depformer steps, PersonaPlex's 16.
        steps = sum(1 for key in shapes if re.fullmatch(r"linears\.\d+\.weight", key))
        lm_arch["dep_q"] = steps or lm_arch["dep_q"]
    if dep_steps is None:
        dep_steps = min(lm_arch["dep_q"], lm_arch["n_q"] // 2)
    what = f"LM checkpoint {path.name}"
    try:
        sources, given = lm_sources(shapes, lm_arch["dep_q"])
        with torch.device("meta"):
            full = LMModel(lm_arch)
            lm = LMModel(lm_arch, dep_steps, dtype)
        check_strict({k: tuple(v.shape) for k, v in full.state_dict().items()}, given, what)
    except (WeightsError, ArchError, ValueError) as error:
        raise ModelFileError(str(error)) from None
    state = {}
    with safe_open(str(path), "pt") as f:
        for key in lm.state_dict():
            source, index, parts = sources[key]
            if parts == 1:
                tensor = f.get_tensor(source)
            else:
                rows = shapes[source][0] // parts
                tensor = f.get_slice(source)[index * rows:(index + 1) * rows]
            state[key] = tensor.to(device=device, dtype=dtype)
    lm.load_state_dict(state, strict=True, assign=True)
    return lm.eval()


def load_mimi_from_dir(path: Path, device: torch.device) -> tuple[Mimi, str]:
    return load_mimi(ModelDir(Path(path), str(path)), device)
