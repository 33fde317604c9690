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


# Speech, told from silence and steady noise by its level: a 20 ms frame is speech when it
# stands 9 dB above the recording's floor (its 10th percentile frame), and above -60 dBFS at
# -24 LUFS. Steady noise, hum and tones vary by well under 1 dB from frame to frame, so
# none of them passes, however loud; speech 7 dB above white noise still does. Frames
# within 100 ms of speech count too: the short dips between a word's sounds.
SPEECH_FRAME_SECONDS = 0.02
SPEECH_ABOVE_FLOOR_DB = 9.0
SPEECH_MIN_DBFS = -60.0
SPEECH_HANGOVER_SECONDS = 0.1


def speech_seconds(pcm: np.ndarray, sample_rate: int) -> float:
    """About how many seconds of mono `pcm` (normalised, as read_voice_audio gives it) are
    speech rather than silence or steady noise."""
    size = round(SPEECH_FRAME_SECONDS * sample_rate)
    count = len(pcm) // size
    if count == 0:
        return 0.0
    frames = np.asarray(pcm[:count * size], dtype=np.float64).reshape(count, size)
    level = 10 * np.log10(np.mean(frames ** 2, axis=1) + 1e-12)
    floor = np.percentile(level, 10)
    speech = (level > floor + SPEECH_ABOVE_FLOOR_DB) & (level > SPEECH_MIN_DBFS)
    reach = round(SPEECH_HANGOVER_SECONDS / SPEECH_FRAME_SECONDS)
    near = np.convolve(speech, np.ones(2 * reach + 1), mode="same") > 0
    return float(near.sum()) * SPEECH_FRAME_SECONDS


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
    """A `.pt` voice, loaded without unpickling code (weights_only), its layout checked
    (`check_voice` checks it against a model)."""
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
        raise InvalidVoiceError(path, "'embeddings' must be a float tensor [frames, 1, 1, dim]")
    if not (isinstance(cache, torch.Tensor) and cache.dim() == 3 and cache.shape[0] == 1
            and not cache.is_floating_point() and not cache.is_complex()
            and cache.dtype != torch.bool):
        raise InvalidVoiceError(path, "'cache' must be an integer tensor [1, streams, columns]")
    if not torch.isfinite(embeddings).all():
        raise InvalidVoiceError(path, "its embeddings hold NaN or infinite values")
    return VoiceEmbeddings(embeddings, cache.long())


class InvalidVoiceError(InputError):
    """A .pt voice whose contents no model could prime with (exit 7)."""

    def __init__(self, path: str | Path, why: str):
        super().__init__(f"{path} is not a valid voice: {why}")


def check_voice(path: str | Path, voice: VoiceEmbeddings, lm: dict) -> None:
    """Refuses a .pt voice that does not fit the language model of arch `lm` (the model's
    cards, streams and width), before any weight loads: a token past a card would index
    outside an embedding table mid-run."""
    dim, streams = lm["dim"], lm["n_q"] + 1
    columns = max(lm["delays"]) + 3  # the generator's token ring
    embeddings, cache = voice.embeddings, voice.cache
    if embeddings.shape[-1] != dim or cache.shape[1] != streams:
        raise InvalidVoiceError(path, f"it was made for another model (embeddings of size "
                                f"{embeddings.shape[-1]} and {cache.shape[1]} streams; this "
                                f"model's are {dim} and {streams})")
    if cache.shape[2] != columns:
        raise InvalidVoiceError(path, f"its token cache has {cache.shape[2]} columns; this "
                                f"model's has {columns}")
    # Row 0 is text (ids up to text_card, its initial token), the others audio codes (up
    # to card); a stored ring holds no absent (-1) or unwritten (-2) slot.
    cards = torch.full((streams,), lm["card"], dtype=torch.long)
    cards[0] = lm["text_card"]
    outside = (cache[0] < 0) | (cache[0] > cards[:, None])
    if outside.any():
        stream = int(outside.any(dim=1).nonzero()[0])
        what = "text" if stream == 0 else "audio"
        raise InvalidVoiceError(path, f"its token cache holds {what} tokens outside "
                                f"0..{int(cards[stream])} (stream {stream})")


def save_voice_pt(fileobj, voice: VoiceEmbeddings) -> None:
    """NVIDIA's layout: {"embeddings": [E, 1, 1, dim] in the model's dtype, "cache": [1, 17, 4]}."""
    torch.save({"embeddings": voice.embeddings.cpu(), "cache": voice.cache.cpu()}, fileobj)
