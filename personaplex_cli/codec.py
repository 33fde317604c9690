"""Audio streams <-> code streams through Mimi, a chunk of frames at a time.

The glue between the file layer (audio/, codes.py) and the engine (core/mimi.py): memory
stays flat whatever the length, because audio is read, encoded and written chunk by chunk,
with Mimi's streaming state carried across chunks (a chunk of N frames gives exactly what N
single-frame calls would).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from .audio.resample import Reframer, StreamResampler
from .core.mimi import Mimi
from .errors import InputError

CHUNK_FRAMES = 25  # 2 s of audio per Mimi call


def _device(mimi: Mimi) -> torch.device:
    return next(mimi.parameters()).device


@torch.inference_mode()
def encode_stream(mimi: Mimi, blocks: Iterable[np.ndarray], sample_rate: int,
                  write_codes: Callable[[np.ndarray], None], *,
                  chunk_frames: int = CHUNK_FRAMES,
                  progress: Callable[[int], None] | None = None) -> int:
    """Encodes mono float32 `blocks` at `sample_rate`; `write_codes` gets int64 [K, n] arrays.

    Returns the number of samples at 24 kHz, before the last frame's zero padding.
    """
    device = _device(mimi)
    state = mimi.encoder_state(1, max_frames=chunk_frames)
    resampler = StreamResampler(sample_rate, mimi.sample_rate)
    framer = Reframer(mimi.frame_size)
    pending: list[np.ndarray] = []
    total = 0

    def run(frames: list[np.ndarray]) -> None:
        pcm = torch.from_numpy(np.concatenate(frames)).to(device).view(1, 1, -1)
        write_codes(mimi.encode(pcm, state)[0].cpu().numpy())

    def take(samples: np.ndarray, final: bool) -> None:
        nonlocal pending, total
        total += len(samples)
        framer.push(samples)
        pending += framer.pop_frames()
        while len(pending) >= chunk_frames or (final and pending):
            run(pending[:chunk_frames])
            pending = pending[chunk_frames:]

    for block in blocks:
        take(resampler.process(block), final=False)
        if progress is not None:
            progress(len(block))
    take(resampler.flush(), final=False)
    last, _ = framer.flush_padded()
    if last is not None:
        pending.append(last)
    take(np.zeros(0, np.float32), final=True)
    if total == 0:
        raise InputError("the input holds no audio samples")
    return total


@torch.inference_mode()
def decode_stream(mimi: Mimi, chunks: Iterable[np.ndarray],
                  write_pcm: Callable[[np.ndarray], None], *, num_samples: int | None = None,
                  chunk_frames: int = CHUNK_FRAMES) -> int:
    """Decodes int [K, n] code chunks (n <= chunk_frames) to 24 kHz float32 PCM.

    The output is trimmed to `num_samples` when given. Returns the number of samples written.
    """
    device = _device(mimi)
    state = mimi.decoder_state(1, max_frames=chunk_frames)
    written = 0
    for codes in chunks:
        if codes.shape[0] > mimi.total_codebooks:
            raise InputError(f"the codes have {codes.shape[0]} codebooks, this Mimi has "
                             f"{mimi.total_codebooks}")
        for start in range(0, codes.shape[1], chunk_frames):
            part = torch.from_numpy(np.ascontiguousarray(codes[:, start:start + chunk_frames]))
            pcm = mimi.decode(part.to(device=device, dtype=torch.long)[None], state)
            pcm = pcm[0, 0].cpu().numpy()
            if num_samples is not None:
                pcm = pcm[:max(0, num_samples - written)]
            written += len(pcm)
            write_pcm(pcm)
    return written
