"""One caller on `/api/chat`, over any transport that can receive, send and close.

The session knows no web framework: it takes a `Transport` (three async callables), so the
same code runs under our Starlette app and under any ASGI host (FastAPI, Ray Serve).

Three tasks run while the call lasts:
- receive: each message is checked (protocol.client_audio), its Ogg pages decoded (no
  faster than real time, plus a burst of what the input queue holds; messages read no
  faster than their byte budget: serve/pace.py) and cut into 80 ms frames for the
  engine's bounded input queue. Pages that come before the
  handshake (Kyutai's client streams from the moment it connects) are decoded, so the
  stream's header pages are kept, but their audio is not stepped: the caller spoke before
  the assistant was there, and stepping it would add the priming time to every later
  frame's latency.
- send: the handshake once the row is live, then each frame's Ogg pages (0x01) and its
  text piece (0x02, PAD and EPAD not sent). Frames wait in a bounded queue; a client that
  does not read loses the oldest (counted), and never holds up the engine.
- watch: the idle timeout (no audio from the caller, or none of its frames read, for
  `idle_timeout`), and with `stats=1` a 0x04 message of the session's figures each second.
The first of them to end the call decides why; the row then leaves its slot at once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

import numpy as np

from ..audio.level import dbfs
from ..core.config import FRAME_MS, FRAME_SIZE
from ..live.jitter import ASSISTANT_QUEUE_MS
from ..runtime.rows import LiveRow
from ..transcript import SILENT
from . import protocol
from .opus import AssistantAudio, CallerAudio
from .pace import ReadBudget

# Assistant frames waiting for a slow reader: the one output bound, talk's speaker's too.
OUTPUT_QUEUE_FRAMES = round(ASSISTANT_QUEUE_MS / FRAME_MS)
WATCH_S = 0.2
SEND_TIMEOUT_S = 2.0  # for the last message and the close, to a client that may be gone


class Cut(Exception):
    """The server's connection layer cut the caller's connection: `str(cut)` says why (it
    missed a ping: it does not read), for the log."""


class Transport(Protocol):
    async def receive(self) -> bytes | str | None:
        """The next message; None once the client has gone (Cut when it was cut)."""

    async def send(self, data: bytes) -> None:
        """Sends one binary message (raises when the client has gone: Cut when it was cut)."""

    async def close(self, code: int) -> None:
        ...


@dataclass
class Ending:
    reason: str  # for the log line: "client closed", "idle", "bad message", ...
    message: str | None = None  # the 0x05 text, if the client is to get one
    code: int = protocol.CLOSE_NORMAL


class Level:
    """RMS level of what the caller sent, over the call and over the last second."""

    def __init__(self):
        self.sum_squares = 0.0
        self.samples = 0
        self._recent: collections.deque = collections.deque(maxlen=12)  # ~1 s of frames

    def add(self, frame: np.ndarray) -> None:
        energy = float(np.dot(frame, frame))
        self.sum_squares += energy
        self.samples += len(frame)
        self._recent.append(energy)

    @property
    def call_dbfs(self) -> float:
        return dbfs(self.sum_squares, self.samples)

    @property
    def recent_dbfs(self) -> float:
        return dbfs(sum(self._recent), len(self._recent) * FRAME_SIZE)


class Call:
    def __init__(self, transport: Transport, row: LiveRow, *, number: int, client: str,
                 idle_timeout: float, stats: bool, engine_stats=None,
                 add_row: Callable[[LiveRow], None], remove_row: Callable[[LiveRow], None]):
        self.transport = transport
        self.row = row
        row.owner = self
        self.number = number
        self.client = client
        self.idle_timeout = idle_timeout
        self.stats = stats
        self.engine_stats = engine_stats
        self._add_row, self._remove_row = add_row, remove_row
        self.caller = CallerAudio()
        self.budget = ReadBudget()
        self.assistant = AssistantAudio()
        self.level = Level()
        self.live = False
        self.began = time.monotonic()
        self.live_at: float | None = None
        self.last_audio = self.last_read = 0.0
        self.early_frames = 0  # decoded before the handshake, not stepped
        self.sent_frames = 0
        self.dropped_out = 0
        self.pieces = 0
        self._out: collections.deque = collections.deque()
        self._handshake_due = False
        self._metadata_due: dict | None = None
        self._ready = asyncio.Event()
        self._ended = asyncio.Event()
        self.ending: Ending | None = None
        self.on_live: Callable[[Call], None] = lambda session: None

    # -- called on the event loop by the switchboard, from the engine's reports --------------

    def went_live(self) -> None:
        self.live = True
        self.live_at = self.last_audio = self.last_read = time.monotonic()
        self._handshake_due = True
        self._ready.set()
        self.on_live(self)

    def deliver(self, pcm: np.ndarray, piece: str) -> None:
        if len(self._out) >= OUTPUT_QUEUE_FRAMES:
            self._out.popleft()
            self.dropped_out += 1
        self._out.append((pcm, piece))
        self._ready.set()

    def end(self, ending: Ending) -> None:
        """The first ending wins."""
        if self.ending is None:
            self.ending = ending
            self._ended.set()

    # -- the call ------------------------------------------------------------------------------

    async def run(self) -> Ending:
        self._add_row(self.row)
        tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._send()),
                 asyncio.create_task(self._watch())]
        try:
            await self._ended.wait()
        finally:
            self._remove_row(self.row)  # the slot is free at the engine's next tick
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        ending = self.ending
        if ending.message is not None:
            await self._say_and_close(ending.message, ending.code)
        return ending

    async def _say_and_close(self, message: str, code: int) -> None:
        try:
            await asyncio.wait_for(self.transport.send(protocol.error(message)), SEND_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - gone already: nothing more to tell it
            pass
        try:
            await asyncio.wait_for(self.transport.close(code), SEND_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            pass

    async def _receive(self) -> None:
        try:
            while True:
                message = await self.transport.receive()
                if message is None:
                    self.end(Ending("client closed"))
                    return
                await self.budget.spend(len(message))
                pages = protocol.client_audio(message)
                if pages is None:
                    continue
                frames = self.caller.push(pages)
                if not self.live:
                    self.early_frames += len(frames)
                    continue
                self.last_audio = time.monotonic()
                for frame in frames:
                    self.level.add(frame)
                    self.row.put(frame)
        except protocol.BadMessage as bad:
            self.end(Ending("bad message", str(bad), bad.close_code))
        except asyncio.CancelledError:
            raise
        except Cut as cut:
            self.end(Ending(str(cut)))
        except Exception as error:  # noqa: BLE001 - the transport failed: the client is gone
            self.end(Ending(f"connection lost ({type(error).__name__})"))

    @property
    def dropped_messages(self) -> int:
        """The caller's messages of audio dropped undecoded: ahead of real time."""
        return self.caller.dropped_pages

    async def _send(self) -> None:
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._handshake_due:
                    self._handshake_due = False
                    await self._greet()
                await self._flush()
        except asyncio.CancelledError:
            raise
        except Cut as cut:
            self.end(Ending(str(cut)))
        except Exception as error:  # noqa: BLE001 - the client is gone
            self.end(Ending(f"connection lost ({type(error).__name__})"))

    async def _greet(self) -> None:
        """The row is live: the protocol's word for it."""
        await self.transport.send(protocol.handshake())

    async def _flush(self) -> None:
        """Everything waiting for the client, sent."""
        send = self.transport.send
        while self._out:
            pcm, piece = self._out.popleft()
            pages = self.assistant.encode(pcm)
            if pages:
                await send(protocol.audio(pages))
            if piece not in SILENT:
                await send(protocol.text(piece))
                self.pieces += 1
            self.sent_frames += 1
            self.last_read = time.monotonic()
            await asyncio.sleep(0)  # a send that does not wait is no turn for the others
        if self._metadata_due is not None:
            value, self._metadata_due = self._metadata_due, None
            await send(protocol.metadata(value))

    async def _watch(self) -> None:
        next_stats = time.monotonic() + 1.0
        while True:
            await asyncio.sleep(WATCH_S)
            if not self.live:
                continue
            now = time.monotonic()
            if now - self.last_audio > self.idle_timeout:
                self.end(Ending("idle", f"no audio for {self.idle_timeout:g} s: closing",
                                protocol.CLOSE_NORMAL))
                return
            if now - self.last_read > self.idle_timeout:
                self.end(Ending("not reading", f"nothing read for {self.idle_timeout:g} s: "
                                "closing", protocol.CLOSE_NORMAL))
                return
            if self.stats and now >= next_stats:
                next_stats += 1.0
                self._metadata_due = self.figures()
                self._ready.set()

    def figures(self) -> dict:
        """The session's numbers (the 0x04 stats message and the log line)."""
        engine = self.engine_stats
        return {
            "slot": self.row.slot,
            "seconds": round(time.monotonic() - (self.live_at or self.began), 2),
            "frames": self.row.frames,
            "late": self.row.late,
            "dropped_in": self.row.dropped_in,
            "dropped_out": self.dropped_out,
            "dropped_pages": self.dropped_messages,
            "waiting_in": self.row.waiting,
            "waiting_out": len(self._out),
            "input_dbfs": round(self.level.recent_dbfs, 1),
            "heard_dbfs": round(self.level.call_dbfs, 1),
            "step_ms_p50": None if engine is None else engine.step_ms(0.5),
            "step_ms_p99": None if engine is None else engine.step_ms(0.99),
        }


@dataclass
class Callables:
    """A Transport made of three async callables, for any host: our Starlette app, or a
    FastAPI/Ray Serve ingress mounting the same endpoint."""

    receive: Callable[[], Awaitable[bytes | str | None]]
    send: Callable[[bytes], Awaitable[None]]
    close: Callable[[int], Awaitable[None]]
