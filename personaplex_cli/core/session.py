"""A conversation: Mimi and the frame generator together, one 80 ms frame at a time.

Caller audio [B, 1920] in -> (assistant audio [B, 1920], the frame's 17 tokens [B, 17]) out,
for B streams in lockstep, with the model's 80 ms lag: the first frame out is the last primed
silence frame. What `step` returns is a host copy (one device-to-host transfer per frame),
never a buffer the next step overwrites, so another thread may hold on to it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from . import priming
from .config import ASSISTANT_CODES
from .graphs import GraphedCodecFrames, make_generator
from .lm import LMModel
from .mimi import Mimi
from .sampling import Sampling


@torch.inference_mode()
def encode_voice(mimi: Mimi, pcm: torch.Tensor, window: str = "nvidia") -> torch.Tensor:
    """Mimi codes [8, N] of a voice recording [L] (24 kHz), streamed like NVIDIA's code."""
    pcm = F.pad(pcm.float().view(1, 1, -1), (0, -pcm.shape[-1] % mimi.frame_size))
    state = mimi.encoder_state(1, max_frames=pcm.shape[-1] // mimi.frame_size, window=window)
    return mimi.encode(pcm.to(next(mimi.parameters()).device), state)[0]


class Session:
    """With `graphs` (default: on CUDA), every per-frame computation replays a CUDA graph;
    `reset()` starts a new conversation on the same graphs."""

    def __init__(self, mimi: Mimi, lm: LMModel, sampling: Sampling = Sampling(), *,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None,
                 window: str = "nvidia", graphs: bool | None = None, batch: int = 1):
        self.mimi = mimi
        self.window = window
        self.batch = batch
        self.device = next(lm.parameters()).device
        self.encoder = mimi.encoder_state(batch, window=window)
        self.decoder = mimi.decoder_state(batch, window=window)
        if graphs is None:
            graphs = self.device.type == "cuda"
        self.gen = make_generator(lm, sampling, generator=generator, window=window,
                                  graphs=graphs, batch=batch)
        if graphs:
            codec = GraphedCodecFrames(mimi, self.encoder, self.decoder, batch)
            self._encode, self._decode = codec.encode, codec.decode
        else:
            self._encode = lambda pcm: mimi.encode(pcm, self.encoder)
            self._decode = lambda codes: mimi.decode(codes, self.decoder)

    @property
    def rngs(self) -> list[torch.Generator]:
        return self.gen.rngs

    def reset(self) -> None:
        """Back to before priming: a new conversation, with the same graphs and generators."""
        self.encoder.reset()
        self.decoder.reset()
        self.gen.reset()

    def prime(self, *, voice_pcm: torch.Tensor | None = None,
              voice: priming.VoiceEmbeddings | None = None,
              text_tokens: list[int] | None = None) -> None:
        """The persona, for every stream at once: a voice (its recording, or a .pt's stored
        embeddings), then the role prompt's tokens."""
        codes = None
        if voice_pcm is not None:
            codes = encode_voice(self.mimi, voice_pcm, self.window)
        priming.prime(self.gen, voice_codes=codes, voice=voice, text_tokens=text_tokens)

    @torch.inference_mode()
    def step(self, pcm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pcm [B, 1920] (or [1920] for one stream) -> host copies of (assistant pcm
        [B, 1920] float32, tokens [B, 17] int64), squeezed back when the input was."""
        single = pcm.dim() == 1
        codes = self._encode(pcm.to(self.device, torch.float32).view(self.batch, 1, -1))
        frame = self.gen.step(user=codes[:, :, 0])  # [B, 17]
        if frame is None:
            raise RuntimeError("prime the session before the conversation")
        audio = self._decode(frame[:, ASSISTANT_CODES, None])[:, 0]  # [B, 1920]
        # One transfer: token ids < 2^24 are exact in float32.
        both = torch.cat([audio, frame.to(audio.dtype)], dim=1).cpu()
        audio, tokens = both[:, :audio.shape[1]], both[:, audio.shape[1]:].long()
        return (audio[0], tokens[0]) if single else (audio, tokens)
