"""Ogg Opus in and out of one session, through Kyutai's sphn (0.2): no Ogg or Opus code here.

The caller's pages decode to 24 kHz PCM, cut into the model's 1920-sample frames (the
browser sends a page per 40 ms, so frames and pages do not line up). The assistant's frames
encode as they come: sphn's writer returns, per 80 ms frame, the Ogg pages it completed
(the first call adds the OpusHead and OpusTags pages in front), and each frame's pages go
out as one 0x01 message, as both reference servers send them.

A caller is decoded at most as fast as real time, with a burst of a second (serve/pace.py):
each message's Opus packets are counted from their TOC bytes (no decoding), so a flood of
dense pages costs the event loop a header walk per message, not a decode.
"""

from __future__ import annotations

import numpy as np

from ..audio.resample import Reframer
from ..core.config import FRAME_SIZE, SAMPLE_RATE
from .pace import BURST_SAMPLES, Allowance
from .protocol import CLOSE_BAD_DATA, BadMessage

# Samples at 48 kHz of one Opus frame, by the TOC's configuration (RFC 6716, 3.1).
_SILK = (480, 960, 1920, 2880)
_HYBRID = (480, 960)
_CELT = (120, 240, 480, 960)
MOST_PACKET_SAMPLES = 5760  # 120 ms at 48 kHz: no valid packet holds more


def _packet_samples(packet: bytes) -> int:
    """Samples at 48 kHz in one Opus packet, from its TOC byte; 0 for the stream's headers
    and anything too short to say."""
    if not packet or packet.startswith((b"OpusHead", b"OpusTags")):
        return 0
    config, code = packet[0] >> 3, packet[0] & 3
    per_frame = (_SILK[config % 4] if config < 12 else _HYBRID[config % 2] if config < 16
                 else _CELT[config % 4])
    frames = 1 if code == 0 else 2 if code in (1, 2) else (
        packet[1] & 0x3F if len(packet) > 1 else 0)
    if per_frame * frames > MOST_PACKET_SAMPLES:
        raise BadMessage("corrupt Ogg Opus audio: a packet longer than 120 ms",
                         CLOSE_BAD_DATA)
    return per_frame * frames


def ogg_opus_samples(data: bytes) -> int:
    """Samples at SAMPLE_RATE that the Opus packets starting in these Ogg pages hold."""
    total = 0
    at = 0
    while at + 27 <= len(data) and data.startswith(b"OggS", at):
        continued = data[at + 5] & 1
        segments = data[at + 27:at + 27 + data[at + 26]]
        body = at + 27 + len(segments)
        starts = not continued
        for lace in segments:
            if starts and lace:
                total += _packet_samples(data[body:body + lace])
            starts = lace < 255
            body += lace
        at = body
    return total * SAMPLE_RATE // 48000


class CallerAudio:
    """A caller's Ogg Opus stream -> model frames."""

    def __init__(self, burst_samples: int = BURST_SAMPLES):
        import sphn

        self._reader = sphn.OpusStreamReader(SAMPLE_RATE)
        self._framer = Reframer(FRAME_SIZE)
        self.allowance = Allowance(burst_samples)

    @property
    def dropped_pages(self) -> int:
        """Messages of pages dropped undecoded: ahead of real time."""
        return self.allowance.dropped

    def push(self, pages: bytes) -> list[np.ndarray]:
        """Decodes whole Ogg pages -> the frames they complete (often none); pages ahead of
        real time beyond the burst are dropped undecoded."""
        if not self.allowance.take(ogg_opus_samples(pages)):
            return []
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
