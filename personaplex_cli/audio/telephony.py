"""The wire formats of OpenAI's Realtime API: PCM16 at 24 kHz, and G.711 μ-law and A-law at
8 kHz (telephony), to and from the model's float32 24 kHz frames.

G.711 is computed here from its definition (ITU-T G.711: a sign bit, a 3-bit segment and a
4-bit step; μ-law with its bias of 33 on a 14-bit scale, A-law on a 13-bit scale with
even bits inverted), on whole arrays at once. The 8 kHz <-> 24 kHz change goes through
soxr (audio/resample.py), one stream each way, so a call's audio is resampled
continuously rather than message by message.
"""

from __future__ import annotations

import numpy as np

from ..core.config import SAMPLE_RATE
from .resample import StreamResampler

TELEPHONY_RATE = 8000
PCM_SCALE = 32768.0

_MU_BIAS = 33  # on μ-law's 14-bit scale
_MU_CLIP = 8159


def to_pcm16(pcm: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16, rounded to nearest and clipped."""
    return np.clip(np.round(np.asarray(pcm, np.float32) * PCM_SCALE), -32768, 32767) \
        .astype(np.int16)


def from_pcm16(samples: np.ndarray) -> np.ndarray:
    return np.asarray(samples, np.int16).astype(np.float32) / PCM_SCALE


def _segment(magnitude: np.ndarray, first_top: int) -> np.ndarray:
    """The G.711 segment (0..7, 8 when over the range) of each magnitude, where segment 0
    ends below `first_top` and each next one doubles."""
    tops = first_top << np.arange(8)
    return np.searchsorted(tops, magnitude, side="right")


def ulaw_encode(samples: np.ndarray) -> np.ndarray:
    """int16 -> μ-law bytes (uint8)."""
    x = np.asarray(samples, np.int32) >> 2  # the 14-bit scale
    sign = np.where(x < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(x), _MU_CLIP) + _MU_BIAS
    segment = _segment(magnitude, 0x40)
    code = np.where(segment >= 8, 0x7F, (np.minimum(segment, 7) << 4)
                    | ((magnitude >> (np.minimum(segment, 7) + 1)) & 0x0F))
    return (~(sign | code) & 0xFF).astype(np.uint8)


def ulaw_decode(data: np.ndarray) -> np.ndarray:
    """μ-law bytes -> int16."""
    code = ~np.asarray(data, np.int32) & 0xFF
    segment = (code >> 4) & 0x07
    magnitude = ((((code & 0x0F) << 3) + (_MU_BIAS << 2)) << segment) - (_MU_BIAS << 2)
    return np.where(code & 0x80, -magnitude, magnitude).astype(np.int16)


def alaw_encode(samples: np.ndarray) -> np.ndarray:
    """int16 -> A-law bytes (uint8)."""
    x = np.asarray(samples, np.int32) >> 3  # the 13-bit scale
    positive = x >= 0
    magnitude = np.where(positive, x, -x - 1)
    segment = _segment(magnitude, 0x20)
    step = np.where(segment < 2, magnitude >> 1, magnitude >> np.maximum(segment, 1)) & 0x0F
    code = np.where(segment >= 8, 0x7F, (np.minimum(segment, 7) << 4) | step)
    return (code ^ np.where(positive, 0xD5, 0x55)).astype(np.uint8)


def alaw_decode(data: np.ndarray) -> np.ndarray:
    """A-law bytes -> int16."""
    code = np.asarray(data, np.int32) ^ 0x55
    segment = (code & 0x70) >> 4
    base = ((code & 0x0F) << 4) + np.where(segment == 0, 8, 0x108)
    magnitude = np.where(segment > 1, base << np.maximum(segment - 1, 0), base)
    return np.where(code & 0x80, magnitude, -magnitude).astype(np.int16)


# format name -> (sample rate, bytes -> int16, int16 -> bytes)
_CODECS = {
    "audio/pcm": (SAMPLE_RATE, lambda b: np.frombuffer(b, "<i2"),
                  lambda s: s.astype("<i2").tobytes()),
    "audio/pcmu": (TELEPHONY_RATE, lambda b: ulaw_decode(np.frombuffer(b, np.uint8)),
                   lambda s: ulaw_encode(s).tobytes()),
    "audio/pcma": (TELEPHONY_RATE, lambda b: alaw_decode(np.frombuffer(b, np.uint8)),
                   lambda s: alaw_encode(s).tobytes()),
}
WIRE_FORMATS = tuple(_CODECS)


class WireDecoder:
    """A caller's bytes in one wire format -> float32 samples at the model's rate, resampled
    as one stream. PCM16 comes through unchanged but for the scale (x / 32768)."""

    def __init__(self, wire_format: str):
        rate, self._decode, _ = _CODECS[wire_format]
        self.width = 2 if wire_format == "audio/pcm" else 1  # bytes per sample
        self.rate = rate
        self._resampler = StreamResampler(rate, SAMPLE_RATE)
        self._odd = b""  # a PCM16 message may end halfway through a sample

    def samples(self, size: int) -> int:
        """The samples at the model's rate that `size` bytes of this format hold (counted
        before decoding)."""
        return size // self.width * SAMPLE_RATE // self.rate

    def decode(self, data: bytes) -> np.ndarray:
        data = self._odd + data
        whole = len(data) - len(data) % self.width
        self._odd = data[whole:]
        return self._resampler.process(from_pcm16(self._decode(data[:whole])))


class WireEncoder:
    """The model's float32 24 kHz frames -> bytes in one wire format (one stream)."""

    def __init__(self, wire_format: str):
        rate, _, self._encode = _CODECS[wire_format]
        self._resampler = StreamResampler(SAMPLE_RATE, rate)

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._encode(to_pcm16(self._resampler.process(pcm)))
