"""Mimi, Kyutai's streaming neural audio codec: 24 kHz audio <-> 12.5 Hz frames of codes.

encode: SEANet encoder -> transformer -> stride-2 conv (25 -> 12.5 Hz) -> split RVQ
decode: split RVQ -> stride-2 transposed conv -> transformer -> SEANet decoder

Whole-chunk calls (`state=None`) pad the input to whole frames and attend with an exact causal
window. Streaming calls take the state of `encoder_state()` / `decoder_state()` and any whole
number of frames at a time; by default the KV rings follow moshi 0.2.13 frame by frame.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .config import ENCODER_FRAME_RATE, FRAME_RATE, FRAME_SIZE, SAMPLE_RATE, MimiArch
from .layers import CODEC_WINDOW, MimiTransformer, Window
from .rvq import SplitRVQ
from .seanet import CausalConv1d, CausalConvTranspose1d, SEANetDecoder, SEANetEncoder
from .streaming import StreamState

STEPS_PER_FRAME = int(ENCODER_FRAME_RATE / FRAME_RATE)  # transformer steps per 80 ms frame


@contextlib.contextmanager
def without_tf32():
    """fp32 products in fp32 on CUDA for the block: cuDNN convolutions default to TF32
    (torch.backends.cudnn.allow_tf32), which rounds their inputs to 10 bits of mantissa, so
    Mimi's codes on a GPU would not be the CPU's. Captured graphs keep the kernels chosen
    here; the flags are put back as they were for whatever else runs (an fp32 LM keeps
    torch's default, also without TF32)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


class Mimi(nn.Module):
    sample_rate = SAMPLE_RATE
    frame_rate = FRAME_RATE
    frame_size = FRAME_SIZE
    dtype = torch.float32  # always: its codes are a file format, and bf16 would change them

    def __init__(self, arch: MimiArch):
        super().__init__()
        seanet, transformer = arch.seanet, arch.transformer
        dim = seanet["dimension"]
        self.encoder = SEANetEncoder(**seanet)
        self.decoder = SEANetDecoder(**seanet)
        self.encoder_transformer = MimiTransformer(**transformer, group=STEPS_PER_FRAME)
        self.decoder_transformer = MimiTransformer(**transformer, group=STEPS_PER_FRAME)
        self.downsample = CausalConv1d(dim, dim, 2 * STEPS_PER_FRAME, stride=STEPS_PER_FRAME,
                                       bias=False, pad_mode="replicate")
        # Depthwise, as the released weights were trained ("upsample_channel_wise_bug").
        self.upsample = CausalConvTranspose1d(dim, dim, 2 * STEPS_PER_FRAME, STEPS_PER_FRAME,
                                              groups=dim, bias=False)
        self.quantizer = SplitRVQ(**arch.quantizer)
        self.cardinality = arch.quantizer["bins"]
        self.total_codebooks = arch.quantizer["n_q"]
        self.num_codebooks = arch.num_codebooks

    def prepare(self) -> "Mimi":
        """Call after loading weights: derives the codebook centroids."""
        self.quantizer.refresh()
        return self

    def set_num_codebooks(self, n: int) -> None:
        if not 1 <= n <= self.total_codebooks:
            raise ValueError(f"the number of codebooks must be within 1..{self.total_codebooks}")
        self.num_codebooks = n

    # -- streaming states -------------------------------------------------------------------

    def encoder_state(self, batch: int = 1, *, max_frames: int = 1,
                      window: Window = CODEC_WINDOW, trim: bool = True) -> StreamState:
        """State for streaming `encode` calls of up to `max_frames` frames each (`trim`:
        attend over the written KV slots only, which CUDA graphs cannot)."""
        return self._state((self.encoder, self.downsample, self.encoder_transformer), batch,
                           max_frames, window, trim)

    def decoder_state(self, batch: int = 1, *, max_frames: int = 1,
                      window: Window = CODEC_WINDOW, trim: bool = True) -> StreamState:
        return self._state((self.decoder, self.upsample, self.decoder_transformer), batch,
                           max_frames, window, trim)

    def _state(self, parts, batch, max_frames, window, trim) -> StreamState:
        state = StreamState()
        for part in parts:
            state.update(StreamState.create(part, batch, dtype=self.dtype,
                                            max_steps=max_frames * STEPS_PER_FRAME,
                                            window=window, trim=trim))
        return state

    # -- codec ------------------------------------------------------------------------------

    def encode_latent(self, pcm: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        # pcm: [B, 1, L] -> unquantized latent [B, dim, F]
        if state is None:
            pcm = F.pad(pcm, (0, -pcm.shape[-1] % self.frame_size))
        elif pcm.shape[-1] == 0 or pcm.shape[-1] % self.frame_size:
            raise ValueError(f"streaming encode needs a positive multiple of {self.frame_size} "
                             f"samples, got {pcm.shape[-1]}")
        latent = self.encoder(pcm, state)
        latent = self.encoder_transformer(latent, state)
        return self.downsample(latent, state)

    def encode(self, pcm: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        """pcm [B, 1, L] float32 -> codes [B, num_codebooks, ceil(L / 1920)] int64."""
        with without_tf32():
            return self.quantizer.encode(self.encode_latent(pcm, state), self.num_codebooks)

    def decode(self, codes: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        """codes [B, K, F] -> pcm [B, 1, F * 1920] float32, untrimmed."""
        with without_tf32():
            latent = self.upsample(self.quantizer.decode(codes), state)
            latent = self.decoder_transformer(latent, state)
            return self.decoder(latent, state)
