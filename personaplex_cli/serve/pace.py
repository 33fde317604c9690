"""How fast a caller may send, one rule for both WebSocket protocols.

- Audio: real time, plus a burst of a second. A caller's audio is counted before it is
  decoded (Ogg pages by their Opus packets' TOC bytes, a Realtime append by its length),
  and a message holding more than the caller's allowance is dropped undecoded, counted.
  A browser's pages delayed by the network, or by a busy server, arrive in a burst: they
  are decoded, and the input queue keeps the newest frames
  (live.jitter.CALLER_QUEUE_FRAMES); over a second ahead, a caller is flooding.
- Bytes: what its messages bring, whatever they hold (READ_BYTES_PER_S, READ_BURST_BYTES).
  Past that the call reads its next message only once the budget is back: the socket
  fills, and TCP holds the sender back, at no cost to the server. Without this, even
  messages dropped undecoded cost the event loop their parsing (the WebSocket frame, the
  UTF-8, the JSON) at whatever rate a client on a fast link sends them, and the engine's
  thread waits for the interpreter meanwhile: every caller's audio stalls.
"""

from __future__ import annotations

import asyncio
import time

from ..core.config import FRAME_SIZE, SAMPLE_RATE

BURST_SAMPLES = SAMPLE_RATE + FRAME_SIZE
# Four times the densest audio a client sends (PCM16 at 24 kHz as base64: 64000 bytes a
# second), and sixteen messages at the size limit at once.
READ_BYTES_PER_S = 256 * 1024
READ_BURST_BYTES = 1024 * 1024


class Allowance:
    """The audio (samples at SAMPLE_RATE) a caller may still send now."""

    def __init__(self, burst_samples: int = BURST_SAMPLES):
        self._burst = burst_samples
        self._left = float(burst_samples)
        self._counted_at = time.monotonic()
        self.dropped = 0  # messages dropped undecoded: ahead of real time

    def take(self, samples: int) -> bool:
        """Whether a message of `samples` may be decoded (False: drop it, counted)."""
        now = time.monotonic()
        self._left = min(self._burst, self._left + (now - self._counted_at) * SAMPLE_RATE)
        self._counted_at = now
        if samples > self._left:
            self.dropped += 1
            return False
        self._left -= samples
        return True


class ReadBudget:
    """The bytes a caller's messages may bring: `spend` returns at once within the budget
    (after giving the other tasks a turn), later past it."""

    def __init__(self, rate: float = READ_BYTES_PER_S, burst: float = READ_BURST_BYTES):
        self._rate, self._burst = rate, burst
        self._left = float(burst)
        self._counted_at = time.monotonic()
        self.waits = 0  # messages read late: the caller sent over its budget

    async def spend(self, size: int) -> None:
        now = time.monotonic()
        self._left = min(self._burst, self._left + (now - self._counted_at) * self._rate)
        self._counted_at = now
        self._left -= size
        if self._left < 0:
            self.waits += 1
            await asyncio.sleep(-self._left / self._rate)
        else:
            # The messages of one network read are all queued at once: without a turn
            # here, the send task (and every other caller) would wait for the lot.
            await asyncio.sleep(0)
