"""From files to ready models: architecture file, safetensors checkpoints, weight identity."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch

from ..core.config import Arch, ArchError, Quantize, arch_from_dict
from ..core.layers import store_wide_linears_input_major
from ..core.lm import LMModel
from ..core.mimi import Mimi
from ..core.quantize import (prepare_linears, quantize_weight, replace_linears,
                             tile_bf16_linears)
from ..core.weights import WeightsError, check_strict, lm_sources, load_strict, mimi_key
from ..errors import ModelInvalidError
from .device import default_dtype, wide_linears_input_major
from .digest import sha256_file
from .files import ModelDir, tool_cache_dir
from .memory import default_dep_steps, release_free_memory
from .native import native_bf16_for, use_native_int8
from .skeleton import shapes_only
from .tensorfile import TensorEntry, TensorFileError, read_header, read_tensor


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
    with shapes_only():  # the checkpoint's tensors become the weights
        mimi = Mimi(arch.mimi)
    try:
        load_strict(mimi, tensors, mimi_key, what=f"Mimi checkpoint {path.name}")
    except WeightsError as error:
        raise ModelFileError(str(error)) from None
    mimi = mimi.prepare().to(device).eval()
    return mimi, weights_sha256(path)


def lm_header(path: Path) -> dict[str, TensorEntry]:
    """The LM checkpoint's tensor entries (names, dtypes, shapes, where their bytes are)."""
    try:
        return read_header(path)
    except TensorFileError as error:
        raise ModelFileError(f"cannot read checkpoint {path}: {error}") from None


def lm_arch_of(arch: Arch, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The LM's architecture as loaded: the architecture file's, with dep_q taken from the
    checkpoint when the file does not set it (Moshiko-shaped checkpoints carry 8 depformer
    steps, PersonaPlex's 16)."""
    lm_arch = dict(arch.lm)
    if "dep_q" not in arch.lm_given:
        steps = sum(1 for key in shapes if re.fullmatch(r"linears\.\d+\.weight", key))
        lm_arch["dep_q"] = steps or lm_arch["dep_q"]
    return lm_arch


def lm_plan(model: ModelDir, dep_steps: int | None = None
            ) -> tuple[Arch, dict, int, dict[str, TensorEntry]]:
    """What loading the LM will build, from the architecture file and the checkpoint's
    header alone -> (arch, the LM's arch as loaded, depformer steps, header entries)."""
    arch = read_arch(model)
    entries = lm_header(model.lm_file())
    lm_arch = lm_arch_of(arch, {key: entry.shape for key, entry in entries.items()})
    return arch, lm_arch, default_dep_steps(lm_arch) if dep_steps is None else dep_steps, entries


def check_files_agree(arch: Arch, lm_arch: dict, tokenizer_pieces: int, tokenizer: str) -> None:
    """Model files that cannot work together, found before any weight is read: a tokenizer
    without a piece for each text token the LM can emit (or with pieces the LM's text
    embedding has no row for), or a Mimi whose codes the LM does not read."""
    text_card = lm_arch["text_card"]
    if tokenizer_pieces != text_card:
        raise ModelFileError(f"the text tokenizer {tokenizer} has {tokenizer_pieces} pieces "
                             f"but the language model's text vocabulary is {text_card}: "
                             "they are not from the same model")
    if arch.mimi.quantizer["bins"] != lm_arch["card"]:
        raise ModelFileError(f"Mimi's codebooks have {arch.mimi.quantizer['bins']} entries "
                             f"but the language model reads {lm_arch['card']}")
    if 2 * arch.mimi.num_codebooks != lm_arch["n_q"]:
        raise ModelFileError(f"Mimi gives {arch.mimi.num_codebooks} codebooks per frame but "
                             f"the language model reads {lm_arch['n_q'] // 2} per speaker")


def load_lm(model: ModelDir, device: torch.device, dtype: torch.dtype | None = None,
            dep_steps: int | None = None, quantize: Quantize = "none") -> LMModel:
    """The language model, strictly checked against the architecture, with `dep_steps`
    depformer steps built and nothing else ever placed on `device`.

    By default only the assistant's codebooks' steps (8 of PersonaPlex's 16): the others
    predict the caller's codes, which are always given. Pass dep_q steps for exact reference
    parity of sampled runs (the skipped steps still draw random numbers there).
    """
    _, lm_arch, dep_steps, entries = lm_plan(model, dep_steps)
    shapes = {key: entry.shape for key, entry in entries.items()}
    path = model.lm_file()
    what = f"LM checkpoint {path.name}"
    try:
        sources, given = lm_sources(shapes, lm_arch["dep_q"])
        with shapes_only():
            full = LMModel(lm_arch)
        check_strict({k: tuple(v.shape) for k, v in full.state_dict().items()}, given, what)
    except (WeightsError, ArchError, ValueError) as error:
        raise ModelFileError(str(error)) from None
    try:
        with open(path, "rb") as fh:
            def read(key: str) -> torch.Tensor:
                source, index, parts = sources[key]
                entry = entries[source]
                rows = None
                if parts > 1:
                    n = entry.shape[0] // parts
                    rows = (index * n, (index + 1) * n)
                return read_tensor(fh, entry, rows)

            return build_lm(lm_arch, dep_steps, device, dtype, quantize, read)
    except (OSError, TensorFileError) as error:
        raise ModelFileError(f"cannot read checkpoint {path}: {error}") from None


def build_lm(lm_arch: dict, dep_steps: int, device: torch.device, dtype: torch.dtype | None,
             quantize: Quantize, tensor_for) -> LMModel:
    """The LM at `lm_arch` with its tensors from `tensor_for(key)` (the checkpoint's, or
    doctor --bench's random ones), one at a time: each is moved to `device` and `dtype`,
    quantized there when its linear is (int8, int4, fp8), and dropped, so the process holds
    the model as loaded plus one tensor of the source at most, on the CPU and on the GPU
    alike. The temporaries of quantizing a tensor are handed back to the system before the
    next tensor comes (`release_free_memory`): left in the C allocator's heaps, between the
    tensors kept, they were RSS beyond the count that no later allocation reused."""
    dtype = dtype or default_dtype(device)
    with shapes_only():
        lm = LMModel(lm_arch, dep_steps, dtype)
    keys = list(lm.state_dict())
    quantized = set(replace_linears(lm, quantize, dtype))
    state = {}
    for key in keys:
        tensor = tensor_for(key).to(device=device, dtype=dtype)
        module = key.rpartition(".")[0]
        if module in quantized:
            for name, value in quantize_weight(quantize, tensor, dtype).items():
                state[f"{module}.{name}"] = value
        else:
            state[key] = tensor
        del tensor  # the source's copy goes as soon as it is used
        if module in quantized:
            # its temporaries, before the next tensor's land beside them; CUDA's allocator
            # reuses its own for the next tensor, so its cache is emptied once, at the end
            release_free_memory(gpu=False)
    lm.load_state_dict(state, strict=True, assign=True)
    del state
    use_native_int8(device, quantize)  # the int8 kernel built here, where it runs
    # the kernels' packing, layer by layer (on the CPU: its heaps trimmed after each)
    prepare_linears(lm, after_each=lambda: release_free_memory(gpu=False))
    lm.fuse_depformer_inputs()
    # its bf16 linears into the tiles of the kernel built here, where it runs them
    tile_bf16_linears(lm, native_bf16_for(device, quantize, dtype),
                      after_each=lambda: release_free_memory(gpu=False))
    if wide_linears_input_major(device, dtype):
        store_wide_linears_input_major(lm)
    release_free_memory()
    return lm.eval()


def load_mimi_from_dir(path: Path, device: torch.device) -> tuple[Mimi, str]:
    return load_mimi(ModelDir(Path(path), str(path)), device)
