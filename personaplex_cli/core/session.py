"""A conversation: Mimi and the frame generator together, one 80 ms frame at a time.

Caller audio [1920] in -> (assistant audio [1920], the frame's 17 tokens) out, with the
model's 80 ms lag: the first frame out is the last primed silence frame.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import priming
from .graphs import GraphedCodecFrames, make_generator
from .lm import LMModel
from .mimi import Mimi
from .sampling import Sampling


class Session:
    """With `graphs` (default: on CUDA), every per-frame computation replays a CUDA graph."""

    def __init__(self, mimi: Mimi, lm: LMModel, sampling: Sampling = Sampling(), *,
                 generator: torch.Generator | None = None, window: str = "nvidia",
                 graphs: bool | None = None):
        self.mimi = mimi
        self.window = window
        self.encoder = mimi.encoder_state(1, window=window)
        self.decoder = mimi.decoder_state(1, window=window)
        device = next(lm.parameters()).device
        if graphs is None:
            graphs = device.type == "cuda"
        self.gen = make_generator(lm, sampling, generator=generator, window=window,
                                  graphs=graphs)
        if graphs:
            codec = GraphedCodecFrames(mimi, self.encoder, self.decoder)
            self._encode, self._decode = codec.encode, codec.decode
        else:
            self._encode = lambda pcm: mimi.encode(pcm, self.encoder)
            self._decode = lambda codes: mimi.decode(codes, self.decoder)

    @torch.inference_mode()
    def voice_codes(self, pcm: torch.Tensor) -> torch.Tensor:
        """Mimi codes [8, N] of a voice recording [L] (24 kHz), streamed like NVIDIA's code."""
        pcm = F.pad(pcm.float().view(1, 1, -1), (0, -pcm.shape[-1] % self.mimi.frame_size))
        frames = pcm.shape[-1] // self.mimi.frame_size
        state = self.mimi.encoder_state(1, max_frames=frames, window=self.window)
        device = next(self.mimi.parameters()).device
        return self.mimi.encode(pcm.to(device), state)[0]

    def prime(self, *, voice_pcm: torch.Tensor | None = None,
              voice: priming.VoiceEmbeddings | None = None,
              text_tokens: list[int] | None = None) -> None:
        codes = self.voice_codes(voice_pcm) if voice_pcm is not None else None
        priming.prime(self.gen, voice_codes=codes, voice=voice, text_tokens=text_tokens)

    @torch.inference_mode()
    def step(self, pcm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pcm [1920] -> (assistant pcm [1920], tokens [17]), both still on the device and,
        with graphs, overwritten by the next step: copy them out (one transfer) first."""
        device = next(self.mimi.parameters()).device
        codes = self._encode(pcm.to(device).view(1, 1, -1))  # [1, 8, 1]
        frame = self.gen.step(user=codes[:, :, 0])
        if frame is None:
            raise RuntimeError("prime the session before the conversation")
        out = self._decode(frame[:, 1:9, None])
        return out[0, 0], frame[0]
