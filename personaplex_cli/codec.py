"""Audio streams <-> code streams through Mimi, a chunk of frames at a time.

The glue between the file layer (audio/, codes.py) and the codec's model (core/mimi.py): memory
stays flat whatever the length, because audio is read, encoded and written chunk by chunk,
with Mimi's streaming state carried across chunks (a chunk of N frames gives exactly what N
single-frame calls would).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from .core.config import CODEC_WINDOW, Window
from .core.mimi import Mimi
from .errors import InputError

CHUNK_FRAMES = 25  # 2 s of audio per Mimi call


def _device(mimi: Mimi) -> torch.device:
    return next(mimi.parameters()).device


@torch.inference_mode()
def encode_stream(mimi: Mimi, chunks: Iterable[np.ndarray],
                  write_codes: Callable[[np.ndarray], None], *,
                  chunk_frames: int = CHUNK_FRAMES) -> int:
    """Encodes 24 kHz PCM chunks of whole frames (`InputFrames.chunks`) under the codec's
    window rule, `CODEC_WINDOW`; `write_codes` gets int64 [K, n] arrays. Returns the number
    of frames encoded."""
    device = _device(mimi)
    state = mimi.encoder_state(1, max_frames=chunk_frames, window=CODEC_WINDOW)
    frames = 0
    for pcm in chunks:
        codes = mimi.encode(torch.from_numpy(pcm).to(device).view(1, 1, -1), state)[0]
        write_codes(codes.cpu().numpy())
        frames += codes.shape[-1]
    if frames == 0:
        raise InputError("the input holds no audio samples")
    return frames


@torch.inference_mode()
def decode_stream(mimi: Mimi, chunks: Iterable[np.ndarray],
                  write_pcm: Callable[[np.ndarray], None], *, num_samples: int | None = None,
                  final_num_samples: Callable[[], int | None] | None = None,
                  window: Window = CODEC_WINDOW, chunk_frames: int = CHUNK_FRAMES) -> int:
    """Decodes int [K, n] code chunks to 24 kHz float32 PCM, trimmed to `num_samples`, with
    the attention window rule the codes were made under (a `.mimi` header records it).

    When the length only arrives with the end of the stream (a `.mimi` trailer),
    `final_num_samples` is asked for it after the last chunk; the last decoded block is held
    back until then. Returns the number of samples written.
    """
    device = _device(mimi)
    state = mimi.decoder_state(1, max_frames=chunk_frames, window=window)
    written = 0
    held: np.ndarray | None = None

    def emit(pcm: np.ndarray, limit: int | None) -> None:
        nonlocal written
        if limit is not None:
            pcm = pcm[:max(0, limit - written)]
        written += len(pcm)
        write_pcm(pcm)

    for codes in chunks:
        if codes.shape[0] > mimi.total_codebooks:
            raise InputError(f"the codes have {codes.shape[0]} codebooks, this Mimi has "
                             f"{mimi.total_codebooks}")
        for start in range(0, codes.shape[1], chunk_frames):
            part = torch.from_numpy(np.ascontiguousarray(codes[:, start:start + chunk_frames]))
            pcm = mimi.decode(part.to(device=device, dtype=torch.long)[None], state)
            pcm = pcm[0, 0].cpu().numpy()
            if final_num_samples is None:
                emit(pcm, num_samples)
                continue
            if held is not None:
                emit(held, None)
            held = pcm
    if held is not None:
        emit(held, final_num_samples())
    return written
