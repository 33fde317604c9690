"""`personaplex serve` attacked while two good callers talk: what each attack costs them.

A `personaplex serve --max-sessions 4` on the tiny checkpoints, started under
`ulimit -n 1024`, and two callers streaming speech at real time throughout. Then, one after
the other, each in its own window:
- quiet:    nothing (the baseline);
- flac:     two POST /api/reply of a FLAC that declares no length (hours of silence);
- big:      six concurrent POST /api/reply of 60 MB each;
- host:     requests and a WebSocket with a foreign Host (DNS rebinding), statuses counted;
- idle:     1000 idle sockets (--idle) held open, and a third caller trying to get in;
- flood:    a caller sending messages of 10 s of Ogg Opus each, as fast as it can.
For each window: the good callers' assistant frames per second (12.5 is real time) and
longest gap without audio, the server's peak RSS and open descriptors, what the attack got.

    python bench/serve_attacks.py [--tree DIR] [--port 18250]

`--tree` runs the server from another checkout (the code before a change) with the same
attacks, for a side-by-side run.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from serve_clients import Call, call, speech  # noqa: E402

WINDOW_S = 10.0


def lengthless_flac(seconds: float, rate: int = 8000) -> bytes:
    """Silence as FLAC whose STREAMINFO leaves its length out (written in blocks)."""
    import soundfile as sf

    data = io.BytesIO()
    block = np.zeros(rate * 60, np.int16)
    with sf.SoundFile(data, "w", rate, 1, format="FLAC") as out:
        for _ in range(int(seconds // 60)):
            out.write(block)
    flac = bytearray(data.getvalue())
    packed = int.from_bytes(flac[18:26], "big") & ~((1 << 36) - 1)
    flac[18:26] = packed.to_bytes(8, "big")
    return bytes(flac)


def big_wav(size: int) -> bytes:
    """A WAV header over `size` bytes of noise (24 kHz mono s16: about 1250 s for 60 MB)."""
    import struct

    data = np.random.default_rng(0).integers(-3000, 3000, size // 2, np.int16).tobytes()
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, 24000, 48000, 2, 16) + b"data" +
            struct.pack("<I", len(data)) + data)


def post(port: int, body: bytes, host: str | None = None, path: str = "/api/reply") -> int:
    """-> the HTTP status (0: no answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as client:
            client.sendall(f"POST {path} HTTP/1.1\r\nHost: {host or f'127.0.0.1:{port}'}\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode())
            client.sendall(body)
            head = client.recv(200)
            return int(head.split()[1]) if head else 0
    except OSError:
        return 0


UPGRADE = ("Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")


def get(port: int, path: str, host: str, headers: str = "") -> int:
    """-> the HTTP status of a GET with exactly this Host (101: a WebSocket opened)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            client.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}\r\n".encode())
            head = client.recv(200)
            return int(head.split()[1]) if head else 0
    except OSError:
        return 0


class Watch:
    """Peak RSS and descriptors of a process, sampled every 0.1 s."""

    def __init__(self, pid: int):
        self.pid = pid
        self.rss = self.fds = 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) // 1024
                fds = len(os.listdir(f"/proc/{self.pid}/fd"))
            except (OSError, AttributeError):
                continue
            self.rss, self.fds = max(self.rss, rss), max(self.fds, fds)

    def reset(self) -> tuple[int, int]:
        peak = (self.rss, self.fds)
        self.rss = self.fds = 0
        return peak


def flood(ws: str, seconds: float, report) -> None:
    """In a process of its own (its sending would starve the good callers' loop here)."""
    import sphn
    import websockets

    async def run() -> None:
        writer = sphn.OpusStreamWriter(24000)
        head = writer.append_pcm(np.zeros(960, np.float32))
        dense = writer.append_pcm(speech(10.0))
        sent = 0
        began = time.monotonic()
        async with websockets.connect(ws, max_size=None, open_timeout=30) as socket_:
            await socket_.recv()
            await socket_.send(b"\x01" + head)
            try:
                while time.monotonic() - began < seconds:
                    await socket_.send(b"\x01" + dense)
                    sent += len(dense) + 1
            except websockets.ConnectionClosed:
                pass
        report.put(f"flood: {sent / 1e6:.1f} MB in {time.monotonic() - began:.1f} s")

    asyncio.run(run())


BODIES: dict[str, bytes] = {}
IDLE_SOCKETS = [1000]


async def attack(name: str, port: int, ws: str) -> str:
    loop = asyncio.get_running_loop()

    async def threads(work, n: int) -> list:
        return await asyncio.gather(*[loop.run_in_executor(None, work) for _ in range(n)])

    if name == "quiet":
        await asyncio.sleep(WINDOW_S)
        return "-"
    if name in ("flac", "big"):
        body, count = BODIES[name], 2 if name == "flac" else 6
        began = time.monotonic()
        statuses = await threads(lambda: post(port, body), count)
        spent = time.monotonic() - began
        await asyncio.sleep(max(0.0, WINDOW_S - spent))
        what = "FLAC of 10 h, no length" if name == "flac" else "WAV"
        return f"{count} x {len(body) / 1e6:.1f} MB {what}: {sorted(statuses)} in {spent:.1f} s"
    if name == "host":
        evil = f"evil.example:{port}"
        statuses = []
        began = time.monotonic()
        while time.monotonic() - began < WINDOW_S:
            for path in ("/api/voices", "/metrics", "/api/health"):
                statuses.append(await loop.run_in_executor(None, get, port, path, evil))
            statuses.append(await loop.run_in_executor(None, post, port, b"x", evil))
            await asyncio.sleep(0.1)
        chat = await loop.run_in_executor(None, get, port, "/api/chat", evil, UPGRADE + (
            f"Origin: http://{evil}\r\n"))
        counts = {s: statuses.count(s) for s in sorted(set(statuses))}
        return f"foreign Host: HTTP {counts}, WebSocket {chat}"
    if name == "idle":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))

        def open_idle() -> list:
            held = []
            for _ in range(IDLE_SOCKETS[0]):
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    break
            return held

        held = await loop.run_in_executor(None, open_idle)  # not on this loop: the callers
        began = time.monotonic()
        try:
            third = await asyncio.wait_for(call(ws, speech(3.0), connect_timeout=8), 15)
            verdict = (f"third caller: handshake in {third.handshake_s:.2f} s, "
                       f"{len(third.pages)} frames")
        except Exception as error:  # noqa: BLE001
            verdict = f"third caller: {type(error).__name__} after {time.monotonic() - began:.1f} s"
        await asyncio.sleep(max(0.0, WINDOW_S - (time.monotonic() - began)))
        for sock in held:
            sock.close()
        return f"{len(held)} idle sockets; {verdict}"
    if name == "flood":
        import multiprocessing

        context = multiprocessing.get_context("fork")
        report = context.Queue()
        flooder = context.Process(target=flood, args=(ws, WINDOW_S, report))
        flooder.start()
        await loop.run_in_executor(None, flooder.join, WINDOW_S + 60)
        return report.get(timeout=5) if not report.empty() else "flood: no report"
    raise ValueError(name)


async def scenario(port: int, pid: int, attacks: list[str]) -> None:
    ws = f"ws://127.0.0.1:{port}/api/chat?greedy=1"
    watch = Watch(pid)
    total = WINDOW_S * (len(attacks) + 3) + 60
    calls = [Call(), Call()]
    good = [asyncio.create_task(call(ws + f"&text_seed={i}", speech(total, seed=i),
                                     result=calls[i])) for i in range(2)]
    while any(c.handshake_s is None for c in calls):
        await asyncio.sleep(0.05)
    await asyncio.sleep(2.0)
    marks = []
    for name in attacks:
        watch.reset()
        began = time.monotonic()
        result = await attack(name, port, ws)
        marks.append((name, began, time.monotonic(), watch.reset(), result))
    for task in good:
        task.cancel()
    await asyncio.gather(*good, return_exceptions=True)
    print(f"{'window':7} {'s':>5} {'frames/s (2 callers)':>21} {'longest gap':>12} "
          f"{'RSS MB':>7} {'fds':>5}  what the attack got")
    for name, began, ended, (rss, fds), result in marks:
        rates, gaps = [], []
        for c in calls:
            times = [t for t in c.audio_times if began <= t <= ended]
            rates.append(len(times) / (ended - began))
            gaps.append(c.longest_gap(began, ended))
        print(f"{name:7} {ended - began:5.1f} {' / '.join(f'{r:5.1f}' for r in rates):>21} "
              f"{max(gaps):11.2f}s {rss:7d} {fds:5d}  {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--port", type=int, default=18250)
    parser.add_argument("--attacks", default="quiet,flac,big,host,idle,flood")
    parser.add_argument("--idle", type=int, default=1000, help="idle sockets to open")
    args = parser.parse_args()
    IDLE_SOCKETS[0] = args.idle
    from conftest import golden_model_folder

    with tempfile.TemporaryDirectory() as scratch:
        model = golden_model_folder(Path(scratch) / "tiny")
        attacks = args.attacks.split(",")
        if "flac" in attacks:
            BODIES["flac"] = lengthless_flac(10 * 3600)
        if "big" in attacks:
            BODIES["big"] = big_wav(60 * 1024 * 1024)
        env = {**os.environ, "PYTHONPATH": str(args.tree.resolve()), "OMP_NUM_THREADS": "1",
               "NO_COLOR": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "personaplex_cli", "serve", "--model", str(model),
             "--device", "cpu", "--port", str(args.port), "--max-sessions", "4",
             "--max-per-client", "0", "--prompt", "Be brief."],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, cwd=scratch,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
        stderr = bytearray()
        ready = threading.Event()

        def collect():
            for line in proc.stderr:
                stderr.extend(line)
                if b"listening on" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=collect, daemon=True).start()
        ready.wait(300)
        try:
            asyncio.run(scenario(args.port, proc.pid, attacks))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        lines = stderr.decode(errors="replace").splitlines()
        print(f"server stderr: {len(stderr)} bytes, {len(lines)} lines, "
              f"{sum('Traceback' in line for line in lines)} tracebacks")
        for line in lines:
            if " ended (" in line:
                print("  " + line[:300])


if __name__ == "__main__":
    main()
