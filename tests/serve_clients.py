"""WebSocket callers for the `serve` tests and bench/serve.py: they speak NVIDIA's protocol
as its browser client does (a 40 ms Ogg Opus page per message, at real-time pace, after
the handshake) and record what comes back, with the time of each message.

Run as a script it is a caller in its own process (the test that kills one mid-stream):
    python serve_clients.py URL SECONDS
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

PAGE_SAMPLES = 960  # 40 ms at 24 kHz: one Ogg page of two 20 ms Opus frames, as the browser


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    """Speech-like caller audio at 24 kHz (conftest.speech_like), looped to `seconds`."""
    from conftest import speech_like

    return speech_like(seconds, seed=seed)


@dataclass
class Call:
    handshake_s: float | None = None  # after connecting
    audio_times: list[float] = field(default_factory=list)  # arrival of each 0x01, monotonic
    pages: list[bytes] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    metadata: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # 0x05 texts
    close_code: int | None = None
    sent_pages: int = 0

    def pcm(self) -> np.ndarray:
        """The assistant's audio, decoded as a client decodes it."""
        import sphn

        reader = sphn.OpusStreamReader(24000)
        return np.concatenate([np.asarray(reader.append_bytes(p), np.float32).reshape(-1)
                               for p in self.pages] or [np.zeros(0, np.float32)])

    def longest_gap(self, start: float, end: float) -> float:
        """Longest time without assistant audio within [start, end]."""
        times = [start] + [t for t in self.audio_times if start <= t <= end] + [end]
        return max(b - a for a, b in zip(times, times[1:]))


def iter_pages(pcm: np.ndarray):
    """Ogg Opus pages of 40 ms each (sphn puts the header pages before the first one),
    each encoded when it is asked for: a caller of minutes does not hold up its event loop
    encoding them all before it sends the first."""
    import sphn

    writer = sphn.OpusStreamWriter(24000)
    for i in range(len(pcm) // PAGE_SAMPLES):
        yield writer.append_pcm(np.ascontiguousarray(
            pcm[i * PAGE_SAMPLES:(i + 1) * PAGE_SAMPLES]))


def pages_of(pcm: np.ndarray) -> list[bytes]:
    return list(iter_pages(pcm))


def corrupt(page: bytes) -> bytes:
    """The page with its Opus packet overwritten (libopus: "corrupted stream")."""
    header = 27 + page[26]  # the page header and its segment table
    return page[:header] + b"\xff" * (len(page) - header)


def pages_of_frames(pcm: np.ndarray) -> list[bytes]:
    """Ogg Opus pages as the server makes them: one append per 80 ms frame."""
    import sphn

    writer = sphn.OpusStreamWriter(24000)
    return [writer.append_pcm(np.ascontiguousarray(pcm[i:i + 1920]))
            for i in range(0, len(pcm) - 1919, 1920)]


async def call(url: str, pcm: np.ndarray, *, read: bool = True, linger_s: float = 0.3,
               wait_handshake: bool = True, connect_timeout: float = 120.0,
               max_queue: int | None = 64, messages: list[bytes] | None = None,
               on_handshake=lambda: None, result: Call | None = None,
               local_addr: tuple[str, int] | None = None) -> Call:
    """One call: connect, (wait for the handshake,) send `pcm` at real-time pace (or the
    raw `messages`), keep reading for `linger_s`, close. With read=False nothing is read.
    `result` is filled as the call goes (for a watcher that cancels it); `local_addr` is
    the address it connects from."""
    import websockets

    result = result if result is not None else Call()
    began = time.monotonic()
    async with websockets.connect(url, max_size=None, max_queue=max_queue,
                                  open_timeout=connect_timeout, close_timeout=2,
                                  local_addr=local_addr) as ws:

        async def receive() -> None:
            try:
                async for message in ws:
                    now = time.monotonic()
                    kind, payload = message[0], message[1:]
                    if kind == 0 and result.handshake_s is None:
                        result.handshake_s = now - began
                    elif kind == 1:
                        result.audio_times.append(now)
                        result.pages.append(payload)
                    elif kind == 2:
                        result.pieces.append(payload.decode())
                    elif kind == 4:
                        import json

                        result.metadata.append(json.loads(payload))
                    elif kind == 5:
                        result.errors.append(payload.decode())
            except websockets.ConnectionClosed:
                pass

        reader = asyncio.create_task(receive()) if read else None
        if wait_handshake and read:
            while result.handshake_s is None and not reader.done():
                await asyncio.sleep(0.005)
            on_handshake()
        if messages is not None:
            for message in messages:
                await ws.send(message)
        elif reader is None or not reader.done():
            t0 = time.monotonic()
            for i, page in enumerate(iter_pages(pcm)):
                delay = t0 + (i + 1) * PAGE_SAMPLES / 24000 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                try:
                    await ws.send(b"\x01" + page)
                except websockets.ConnectionClosed:
                    break
                result.sent_pages += 1
                if reader is not None and reader.done():
                    break
        if reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(reader), linger_s)
            except asyncio.TimeoutError:
                pass
        await ws.close()
        if reader is not None:
            await reader
        result.close_code = ws.close_code
    return result


@contextlib.contextmanager
def serving(model_dir, cache_dir, access, *, role: str, max_sessions: int,
            prepare=lambda server: None):
    """`personaplex serve`'s Server on the model (voice NATF2, `role`), run by a thread on a
    free port of 127.0.0.1 until the block ends -> (its base URL, the Server, its log lines).
    Its warm-up remembers its thread count in `cache_dir`, not the user's cache;
    `prepare(server)` runs before it listens."""
    from personaplex_cli.serve.query import Defaults
    from personaplex_cli.serve.runner import bind
    from personaplex_cli.serve.server import Server

    lines: list[str] = []
    cache = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache_dir)
    try:
        server = Server.open(str(model_dir), "cpu", None, Defaults(voice="NATF2", role=role),
                             access, max_sessions=max_sessions, idle_timeout=4.0,
                             static_dir=None, log=lines.append, debug=lines.append)
    finally:
        if cache is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = cache
    prepare(server)
    sock = bind("127.0.0.1", 0)
    ready = threading.Event()
    stop = []
    thread = threading.Thread(target=server.run, args=(sock,), daemon=True, kwargs=dict(
        on_ready=lambda s: (stop.append(s), ready.set()), handle_signals=False))
    thread.start()
    assert ready.wait(60), lines
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, lines
    finally:
        stop[0]()
        thread.join(10)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    got = asyncio.run(call(sys.argv[1], speech(float(sys.argv[2])),
                           on_handshake=lambda: print("handshake", flush=True)))
    print(f"{len(got.pages)} frames", flush=True)


class ServeProcess:
    """`personaplex serve ARGS` as a subprocess with its stderr collected line by line:
    `lines`, `listening` (set at its "listening on" line), `base` (http://HOST:PORT)."""

    def __init__(self, args, env: dict):
        import subprocess
        import threading

        self.proc = subprocess.Popen([sys.executable, "-m", "personaplex_cli", "serve", *args],
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.listening = threading.Event()
        self.collector = threading.Thread(target=self._collect, daemon=True)
        self.collector.start()

    def _collect(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "listening on" in line:
                self.listening.set()

    @property
    def start_line(self) -> str:
        return next(line for line in self.lines if "listening on" in line)

    @property
    def base(self) -> str:
        return self.start_line.split("listening on ")[1].split("/ ")[0]

    def stop(self) -> None:
        """Killed if still running; its stderr read to the end."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.collector.join(5)
