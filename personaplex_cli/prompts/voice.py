"""Voice prompts: a recording (normalised to -24 LUFS, then Mimi-encoded) or a `.pt` file
holding NVIDIA's stored input embeddings and token ring."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..core.config import SAMPLE_RATE
from ..core.priming import VoiceEmbeddings
from ..errors import InputError

TARGET_LUFS = -24.0
MIN_SECONDS = 0.4  # the loudness meter's gating block


def normalize_loudness(pcm: np.ndarray, sample_rate: int,
                       target_lufs: float = TARGET_LUFS) -> np.ndarray:
    """Mono PCM scaled to `target_lufs` integrated loudness (ITU-R BS.1770), as float64."""
    import pyloudnorm

    if len(pcm) < MIN_SECONDS * sample_rate:
        raise InputError(f"the voice prompt is too short: at least {MIN_SECONDS} s is needed")
    meter = pyloudnorm.Meter(sample_rate)
    loudness = meter.integrated_loudness(pcm.astype(np.float64))
    if not np.isfinite(loudness):
        raise InputError("the voice prompt is silent")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyloudnorm warns when the gain clips; we keep it
        return pyloudnorm.normalize.loudness(pcm.astype(np.float64), loudness, target_lufs)


def read_voice_audio(path: str, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A voice recording as mono float64 at `sample_rate`, normalised to -24 LUFS."""
    from ..audio.io import open_audio
    from ..audio.resample import StreamResampler

    with open_audio(path) as reader:
        resampler = StreamResampler(reader.sample_rate, sample_rate)
        parts = [resampler.process(block) for block in reader.blocks(reader.sample_rate)]
        parts.append(resampler.flush())
    return normalize_loudness(np.concatenate(parts), sample_rate)


def load_voice_pt(path: str | Path) -> VoiceEmbeddings:
    """A `.pt` voice, loaded without unpickling code (weights_only)."""
    import warnings

    not_a_voice = InputError(f"{path} is not a voice file (.pt with embeddings and cache)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about a legacy pickle's protocol
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # junk, a pickle carrying code, another torch file: torch's type and
        raise not_a_voice from None  # its text would tell a user nothing more
    if not isinstance(data, dict) or set(data) != {"embeddings", "cache"}:
        raise not_a_voice
    embeddings, cache = data["embeddings"], data["cache"]
    if not (isinstance(embeddings, torch.Tensor) and embeddings.dim() == 4
            and embeddings.shape[1:3] == (1, 1) and embeddings.is_floating_point()
            and embeddings.shape[0] > 0):
        raise InputError(f"{path}: 'embeddings' must be a tensor [frames, 1, 1, dim]")
    if not (isinstance(cache, torch.Tensor) and cache.dim() == 3 and cache.shape[0] == 1
            and not cache.is_floating_point()):
        raise InputError(f"{path}: 'cache' must be an integer tensor [1, streams, columns]")
    return VoiceEmbeddings(embeddings, cache.long())


def save_voice_pt(fileobj, voice: VoiceEmbeddings) -> None:
    """NVIDIA's layout: {"embeddings": [E, 1, 1, dim] in the model's dtype, "cache": [1, 17, 4]}."""
    torch.save({"embeddings": voice.embeddings.cpu(), "cache": voice.cache.cpu()}, fileobj)
