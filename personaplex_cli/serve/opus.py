"""Ogg Opus in and out of one session, through Kyutai's sphn (0.2): no Ogg or Opus code here.

The caller's pages decode to 24 kHz PCM, cut into the model's 1920-sample frames (the
browser sends a page per 40 ms, so frames and pages do not line up). The assistant's frames
encode as they come: sphn's writer returns, per 80 ms frame, the Ogg pages it completed
(the first call adds the OpusHead and OpusTags pages in front), and each frame's pages go
out as one 0x01 message, as both reference servers send them.
"""

from __future__ import annotations

import numpy as np

from ..audio.resample import Reframer
from ..core.config import FRAME_SIZE, SAMPLE_RATE
from .protocol import CLOSE_BAD_DATA, BadMessage


class CallerAudio:
    """A caller's Ogg Opus stream -> model frames."""

    def __init__(self):
        import sphn

        self._reader = sphn.OpusStreamReader(SAMPLE_RATE)
        self._framer = Reframer(FRAME_SIZE)

    def push(self, pages: bytes) -> list[np.ndarray]:
        """Decodes whole Ogg pages -> the frames they complete (often none)."""
        try:
            pcm = self._reader.append_bytes(pages)
        except ValueError as error:  # sphn's word for a malformed page or Opus packet
            raise BadMessage(f"corrupt Ogg Opus audio: {error}", CLOSE_BAD_DATA) from None
        self._framer.push(np.asarray(pcm, np.float32).reshape(-1))
        return self._framer.pop_frames()


class AssistantAudio:
    """Model frames -> Ogg Opus pages."""

    def __init__(self):
        import sphn

        self._writer = sphn.OpusStreamWriter(SAMPLE_RATE)

    def encode(self, pcm: np.ndarray) -> bytes:
        """One 1920-sample frame -> the pages it completes (headers first, the first time)."""
        return self._writer.append_pcm(np.ascontiguousarray(pcm, np.float32))
