"""`serve` attacked while good callers talk: the attackers, the good callers and the
watches that tell what the attack cost them (tests/test_serve_hostile.py and
bench/serve_attacks.py).

Good callers connect from GOOD_ADDRESS, another loopback address than the attackers', so
that `--max-per-client` counts them apart, as it would count a stranger apart from the
callers it shares a server with. Each attacker runs in a process of its own (`apart`): its
sending would otherwise starve the good callers' event loop in the measuring process, and
the figures would blame the server for the measuring process's own stall.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GOOD_ADDRESS = "127.0.0.2"
FRAME = 1920
FRAME_S = 0.08
REALTIME_MODEL = "personaplex-7b-v1"


# -- watches -----------------------------------------------------------------------------------

def health_seconds(base: str, timeout: float = 5.0) -> float:
    """How long GET /api/health took to answer (inf: not within `timeout`)."""
    began = time.monotonic()
    try:
        with urllib.request.urlopen(base + "/api/health", timeout=timeout) as response:
            response.read()
    except OSError:
        return float("inf")
    return time.monotonic() - began


class Watch:
    """Every 0.25 s, on a thread: the server's RSS (MB) and how long /api/health took.
    `window(began, ended)` -> (longest health answer, peak RSS) within it."""

    def __init__(self, base: str, pid: int, every_s: float = 0.25):
        self.base, self.pid, self.every_s = base, pid, every_s
        self.health: list[tuple[float, float]] = []  # (asked at, seconds)
        self.rss: list[tuple[float, int]] = []
        self._stop = threading.Event()
        threading.Thread(target=self._rss, daemon=True).start()
        threading.Thread(target=self._health, daemon=True).start()

    def _rss(self) -> None:
        while not self._stop.wait(0.1):
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                self.rss.append((time.monotonic(),
                                 int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) // 1024))
            except (OSError, AttributeError):
                pass

    def _health(self) -> None:
        while not self._stop.wait(self.every_s):
            asked = time.monotonic()
            self.health.append((asked, health_seconds(self.base)))

    def rss_now(self) -> int:
        return self.rss[-1][1] if self.rss else 0

    def window(self, began: float, ended: float) -> tuple[float, int]:
        health = [s for t, s in self.health if began <= t <= ended]
        rss = [r for t, r in self.rss if began <= t <= ended]
        return max(health, default=0.0), max(rss, default=0)

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Heard:
    """When a good caller got each 80 ms frame of the assistant's audio."""

    frame_times: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    closed: str | None = None

    def audio_per_second(self, began: float, ended: float) -> float:
        """Seconds of the assistant's audio received per second of [began, ended]."""
        frames = sum(began <= t <= ended for t in self.frame_times)
        return frames * FRAME_S / (ended - began)

    def longest_gap(self, began: float, ended: float) -> float:
        times = [began] + [t for t in self.frame_times if began <= t <= ended] + [ended]
        return max(b - a for a, b in zip(times, times[1:]))


# -- good callers ------------------------------------------------------------------------------

async def chat_caller(ws: str, pcm: np.ndarray, heard: Heard) -> None:
    """NVIDIA's protocol from GOOD_ADDRESS, as serve_clients.call speaks it: each audio
    message is one 80 ms frame of the assistant."""
    from serve_clients import Call, call

    got = Call()
    waiting = asyncio.create_task(call(ws, pcm, result=got, local_addr=(GOOD_ADDRESS, 0)))
    try:
        seen = 0
        while not waiting.done():
            await asyncio.sleep(0.05)
            heard.frame_times.extend(got.audio_times[seen:])
            seen = len(got.audio_times)
        await waiting
        heard.frame_times.extend(got.audio_times[seen:])
    except asyncio.CancelledError:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        raise
    finally:
        heard.errors.extend(got.errors)


async def realtime_caller(ws: str, pcm: np.ndarray, heard: Heard) -> None:
    """OpenAI's Realtime API from GOOD_ADDRESS: PCM16 appended 80 ms at a time at real
    time, every event read. Its figure counts the model's frames that reached it: the audio
    deltas, and the frames between responses (the model's silence, which the protocol does
    not send), from each response's `start_frame`."""
    import websockets

    async with websockets.connect(f"{ws}?model={REALTIME_MODEL}", max_size=None,
                                  compression=None, open_timeout=60,
                                  local_addr=(GOOD_ADDRESS, 0)) as connection:
        async def read() -> None:
            try:
                async for message in connection:
                    event = json.loads(message)
                    if event["type"] == "response.output_audio.delta":
                        heard.frame_times.append(time.monotonic())
                    elif event["type"] == "error":
                        heard.errors.append(event["error"]["message"])
            except websockets.ConnectionClosed as closed:
                heard.closed = str(closed)

        reader = asyncio.create_task(read())
        data = (np.clip(np.round(pcm * 32768), -32768, 32767).astype("<i2")).tobytes()
        began = time.monotonic()
        try:
            for k in range(len(data) // (2 * FRAME)):
                await asyncio.sleep(max(0.0, began + k * FRAME_S - time.monotonic()))
                chunk = base64.b64encode(data[k * 2 * FRAME:(k + 1) * 2 * FRAME]).decode()
                await connection.send(json.dumps({"type": "input_audio_buffer.append",
                                                  "audio": chunk}))
        except websockets.ConnectionClosed:
            pass
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


# -- attackers (each in a process of its own) --------------------------------------------------

def apart(target, *args, timeout: float = 120.0):
    """target(*args) in a forked process -> what it returned (a string saying what it did)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    process = context.Process(target=lambda: results.put(target(*args)), daemon=True)
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
    return results.get(timeout=5) if not results.empty() else f"{target.__name__}: no report"


def realtime_flood(ws: str, seconds: float, *, connections: int = 1,
                   compress: bool = True, append_bytes: int = 750_000,
                   event_id_bytes: int = 0, read: bool = True,
                   reconnect: bool = False) -> str:
    """`connections` clients of /v1/realtime, each sending as fast as it can for
    `seconds`: appends of `append_bytes` of base64 zeros, or (with `event_id_bytes`)
    unknown events whose event_id is that long. The `websockets` client offers
    permessage-deflate unless `compress` is False. Without `read` nothing is read. With
    `reconnect`, a connection the server closes is opened again. -> what it sent and how
    it ended."""
    import websockets

    if ws.endswith("/api/chat"):  # NVIDIA's protocol: binary audio messages of zeros
        message, url = b"\x01OggS" + bytes(append_bytes), ws
    elif event_id_bytes:
        message = json.dumps({"type": "nonsense.event", "event_id": "e" * event_id_bytes})
    else:
        message = json.dumps({"type": "input_audio_buffer.append",
                              "audio": "A" * (append_bytes // 4 * 4)})
    url = ws if ws.endswith("/api/chat") else f"{ws}?model={REALTIME_MODEL}"
    totals = {"messages": 0, "bytes": 0, "connections": 0}
    closes: dict[str, int] = {}

    async def one(deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                async with websockets.connect(
                        url, max_size=None, open_timeout=10, close_timeout=1,
                        compression="deflate" if compress else None,
                        max_queue=None if read else 1) as connection:
                    totals["connections"] += 1
                    drain = asyncio.create_task(_drain(connection)) if read else None
                    try:
                        while time.monotonic() < deadline:
                            await asyncio.wait_for(connection.send(message),
                                                   deadline - time.monotonic())
                            totals["messages"] += 1
                            totals["bytes"] += len(message)
                    except asyncio.TimeoutError:  # the server stopped reading it
                        pass
                    finally:
                        if drain is not None:
                            drain.cancel()
                        connection.transport.abort()  # no closing handshake to wait for
            except websockets.ConnectionClosed as closed:
                code = closed.rcvd.code if closed.rcvd else "none"
                closes[str(code)] = closes.get(str(code), 0) + 1
            except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as error:
                closes[type(error).__name__] = closes.get(type(error).__name__, 0) + 1
                await asyncio.sleep(0.1)
            if not reconnect:
                await asyncio.sleep(max(0.0, deadline - time.monotonic()))

    async def run() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(one(deadline) for _ in range(connections)))

    asyncio.run(run())
    return (f"{connections} x {'deflate' if compress else 'plain'}"
            f"{'' if read else ', never reading'}: {totals['messages']} messages, "
            f"{totals['bytes'] / 1e6:.0f} MB of JSON over {totals['connections']} "
            f"connection(s), closes {closes}")


async def _drain(connection) -> None:
    try:
        async for _ in connection:
            pass
    except Exception:  # noqa: BLE001 - the server closed it
        pass


def stream_request(recording: bytes) -> bytes:
    """A streamed /v1/chat/completions request for `recording` (a WAV or FLAC file)."""
    body = json.dumps({"model": REALTIME_MODEL, "stream": True,
                       "modalities": ["text", "audio"], "audio": {"format": "pcm16"},
                       "messages": [{"role": "user", "content": [{
                           "type": "input_audio", "input_audio": {
                               "data": base64.b64encode(recording).decode(),
                               "format": "flac"}}]}]}).encode()
    return body


def unread_streams(base: str, recording: bytes, count: int, hold_s: float) -> str:
    """`count` streamed chat completions of `recording`, posted from sockets that never
    read (a receive buffer of 4 KiB), held for `hold_s`. -> how many the server closed
    meanwhile, and after how long."""
    host, port = base.split("//")[1].rsplit(":", 1)
    body = stream_request(recording)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sockets = []
    began = time.monotonic()
    for _ in range(count):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        client.sendall(head + body)
        sockets.append(client)
    closed_after: list[float] = []
    while time.monotonic() - began < hold_s and len(closed_after) < count:
        time.sleep(0.1)
        for client in sockets:
            if client.fileno() < 0:
                continue
            if _peer_closed(client):
                closed_after.append(time.monotonic() - began)
                client.close()
    for client in sockets:
        client.close()
    return (f"{count} unread stream(s) of {len(body) / 1e6:.1f} MB requests: "
            f"{len(closed_after)} cut by the server "
            f"({', '.join(f'{s:.1f} s' for s in closed_after) or 'none'})")


def _peer_closed(client: socket.socket) -> bool:
    """Whether the server closed or reset the connection, without reading its data (the
    socket's buffer stays full): a zero-length poll for the error or hang-up."""
    import select

    poller = select.poll()
    poller.register(client, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def speech_flac(seconds: float, rate: int = 8000) -> bytes:
    """Speech-like audio as a FLAC file's bytes."""
    import io

    import soundfile as sf
    from conftest import speech_like

    out = io.BytesIO()
    sf.write(out, speech_like(seconds, rate), rate, format="FLAC")
    return out.getvalue()


def server_pid_rss(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) // 1024
    except (OSError, AttributeError):
        return 0


def environment_for(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree.resolve()), "NO_COLOR": "1"}


# -- a run: good callers throughout, attacks one after the other ------------------------------

@dataclass
class Window:
    """What one attack cost the good callers, from its start to `after_s` past its end."""

    name: str
    seconds: float
    chat: float  # seconds of audio a second, the /api/chat caller
    chat_gap: float  # its longest time without audio
    realtime: float  # the same for the /v1/realtime caller
    realtime_gap: float
    health_s: float  # the longest /api/health answer (inf: none within 5 s)
    rss_mb: int  # the server's peak
    what: str  # what the attacker reported

    def row(self) -> str:
        health = "none in 5 s" if self.health_s == float("inf") else f"{self.health_s:.2f} s"
        return (f"{self.name:10} {self.seconds:5.1f} {self.chat:5.2f} {self.chat_gap:5.2f} s "
                f"{self.realtime:5.2f} {self.realtime_gap:5.2f} s {health:>11} "
                f"{self.rss_mb:6d}  {self.what}")


HEADER = (f"{'attack':10} {'s':>5} {'chat':>5} {'gap':>7} {'rt':>5} {'gap':>7} "
          f"{'health':>11} {'RSS MB':>6}  what the attacker did")


async def under_attack(base: str, pid: int, attacks: list, *, after_s: float = 1.0,
                       caller_s: float | None = None) -> list[Window]:
    """Two good callers (/api/chat and /v1/realtime, speech at real time) throughout;
    `attacks` [(name, target, args)] run one after the other, each `apart`; a window per
    attack, from its start to `after_s` past its end."""
    from conftest import speech_like

    ws = "ws" + base[4:]
    caller_s = caller_s or 90.0 + 30.0 * len(attacks)  # past the last window
    watch = Watch(base, pid)
    chat, rt = Heard(), Heard()
    good = [asyncio.create_task(chat_caller(ws + "/api/chat?greedy=1",
                                            speech_like(caller_s, seed=1), chat)),
            asyncio.create_task(realtime_caller(ws + "/v1/realtime",
                                                speech_like(caller_s, seed=2), rt))]
    began = time.monotonic()
    while (not chat.frame_times or not rt.frame_times) and time.monotonic() - began < 60:
        if any(task.done() for task in good):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    loop = asyncio.get_running_loop()
    windows = []
    try:
        for name, target, args in attacks:
            began = time.monotonic()
            what = await loop.run_in_executor(None, apart, target, *args)
            await asyncio.sleep(after_s)
            ended = time.monotonic()
            health, rss = watch.window(began, ended)
            windows.append(Window(name, ended - began, chat.audio_per_second(began, ended),
                                  chat.longest_gap(began, ended),
                                  rt.audio_per_second(began, ended),
                                  rt.longest_gap(began, ended), health, rss, what))
    finally:
        watch.stop()
        for task, heard in zip(good, (chat, rt)):
            if task.done() and task.exception() is not None:
                heard.errors.append(repr(task.exception()))
            task.cancel()
        await asyncio.gather(*good, return_exceptions=True)
    for window in windows:
        window.what += "".join(f"; {name} caller: {heard.errors[:2]}" for name, heard in
                               (("chat", chat), ("realtime", rt)) if heard.errors)
    return windows


def quiet(seconds: float) -> str:
    time.sleep(seconds)
    return "nothing"
