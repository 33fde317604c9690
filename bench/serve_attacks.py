"""`personaplex serve` attacked while two good callers talk: what each attack costs them.

A `personaplex serve` at its default options on the tiny checkpoints but
`--max-sessions 8` (the default follows the warm-up, which a busy machine brings down to
one seat: the attackers would then be refused, not measured), started under
`ulimit -n 1024`, and two good callers streaming speech at real time throughout, one on
/api/chat and one on /v1/realtime, from another loopback address than the attackers
(tests/hostile_clients.py). Then, one after the other, each in its own window and a
process of its own:

issue 30's (OpenAI's routes):
- deflate:    Realtime appends of 750 kB of base64 zeros as fast as a `websockets` client
              sends them, with its default compression;
- event_id:   unknown Realtime events with a 1 MB event_id, compressed;
- four:       four deflate connections at once;
- no reader:  deflate appends from a client that never reads;
- streams:    eight streamed /v1/chat/completions of a 590 s FLAC from sockets that never
              read;
beyond them (what an attacker does once those are closed):
- plain 60k:  appends just under the message limit, uncompressed, as fast as they go (and
              `id 60k`: unknown events of that size; `four 60k`; `no reader 60k`);
- churn:      deflate appends from a client that connects again each time it is closed
              (`churn 4`: four of them; `chat churn`: the same on /api/chat);
the older ones:
- flac:       two POST /api/reply of a FLAC that declares no length (hours of silence);
- big:        six concurrent POST /api/reply of 60 MB each;
- host:       requests and a WebSocket with a foreign Host (DNS rebinding);
- idle:       1000 idle sockets held open;
- flood:      a caller sending messages of 10 s of Ogg Opus each, as fast as it can.

For each window (the attack, and a second after it): each good caller's seconds of the
assistant's audio a second (1.0 is real time) and longest gap, /api/health's longest
answer, the server's peak RSS, what the attacker did.

    python bench/serve_attacks.py [--tree DIR ...] [--window 12] [--attacks a,b,...]

Each `--tree` runs the server from that checkout (the code before a change, then after),
in turn, `--rounds` times over (ABAB), so that both see the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import os
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
import hostile_clients as hostile  # noqa: E402
from serve_clients import speech  # noqa: E402


# -- the older attacks, each a function of (base, seconds) run in a process of its own -------

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


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def uploads(base: str, seconds: float, body: bytes, count: int, what: str) -> str:
    from concurrent.futures import ThreadPoolExecutor

    began = time.monotonic()
    with ThreadPoolExecutor(count) as pool:
        statuses = list(pool.map(lambda _: post(port_of(base), body), range(count)))
    spent = time.monotonic() - began
    time.sleep(max(0.0, seconds - spent))
    return f"{count} x {len(body) / 1e6:.1f} MB {what}: {sorted(statuses)} in {spent:.1f} s"


def foreign_host(base: str, seconds: float) -> str:
    port = port_of(base)
    evil = f"evil.example:{port}"
    statuses = []
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        for path in ("/api/voices", "/metrics", "/api/health"):
            statuses.append(get(port, path, evil))
        statuses.append(post(port, b"x", evil))
        time.sleep(0.1)
    chat = get(port, "/api/chat", evil, UPGRADE + f"Origin: http://{evil}\r\n")
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    return f"foreign Host: HTTP {counts}, WebSocket {chat}"


def idle_sockets(base: str, seconds: float, count: int = 1000) -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection(("127.0.0.1", port_of(base)), timeout=5))
        except OSError:
            break
    time.sleep(seconds)
    for sock in held:
        sock.close()
    return f"{len(held)} idle sockets"


def opus_flood(base: str, seconds: float) -> str:
    import sphn
    import websockets

    async def run() -> str:
        writer = sphn.OpusStreamWriter(24000)
        head = writer.append_pcm(np.zeros(960, np.float32))
        dense = writer.append_pcm(speech(10.0))
        sent = 0
        began = time.monotonic()
        async with websockets.connect("ws" + base[4:] + "/api/chat", max_size=None,
                                      open_timeout=30, close_timeout=1) as ws:
            await ws.recv()
            await ws.send(b"\x01" + head)
            try:
                while time.monotonic() - began < seconds:
                    await asyncio.wait_for(ws.send(b"\x01" + dense),
                                           max(0.01, seconds - (time.monotonic() - began)))
                    sent += len(dense) + 1
            except (websockets.ConnectionClosed, asyncio.TimeoutError):
                pass
            ws.transport.abort()
        return f"opus flood: {sent / 1e6:.1f} MB in {time.monotonic() - began:.1f} s"

    return asyncio.run(run())


# -- the attacks by name -------------------------------------------------------------------

def attacks_for(base: str, seconds: float, names: list[str]) -> list:
    realtime, chat = "ws" + base[4:] + "/v1/realtime", "ws" + base[4:] + "/api/chat"
    flood = functools.partial(hostile.realtime_flood, realtime, seconds)
    plain = functools.partial(flood, compress=False, append_bytes=60_000)
    table = {
        "quiet": (hostile.quiet, (seconds,)),
        "deflate": (flood, ()),
        "event_id": (functools.partial(flood, event_id_bytes=1_000_000), ()),
        "four": (functools.partial(flood, connections=4), ()),
        "no reader": (functools.partial(flood, read=False), ()),
        "streams": (hostile.unread_streams, (base, hostile.speech_flac(590.0), 8, seconds)),
        "plain 60k": (plain, ()),
        "id 60k": (functools.partial(flood, compress=False, event_id_bytes=60_000), ()),
        "four 60k": (functools.partial(plain, connections=4), ()),
        "noread 60k": (functools.partial(plain, read=False), ()),
        "churn": (functools.partial(flood, reconnect=True), ()),
        "churn 4": (functools.partial(flood, reconnect=True, connections=4), ()),
        "chat churn": (functools.partial(hostile.realtime_flood, chat, seconds,
                                         reconnect=True), ()),
        "flac": (uploads, (base, seconds, lengthless_flac(10 * 3600), 2,
                           "FLAC of 10 h, no length")),
        "big": (uploads, (base, seconds, big_wav(60 * 1024 * 1024), 6, "WAV")),
        "host": (foreign_host, (base, seconds)),
        "idle": (idle_sockets, (base, seconds)),
        "flood": (opus_flood, (base, seconds)),
    }
    return [(name, *table[name]) for name in names]


ISSUE = "quiet,deflate,event_id,four,no reader,streams"
BEYOND = "plain 60k,id 60k,four 60k,noread 60k,churn,churn 4,chat churn"
OLDER = "flac,big,host,idle,flood"


def run_tree(tree: Path, model: Path, scratch: Path, seconds: float, names: list[str],
             extra: list[str]) -> tuple[list, list[str]]:
    """One server from `tree`, every attack in turn -> (windows, its stderr lines)."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "NO_COLOR": "1",
           "XDG_CACHE_HOME": str(scratch / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "personaplex_cli", "serve", "--model", str(model),
         "--device", "cpu", "--port", "0", *extra],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        cwd=scratch, text=True,  # not the repository: `python -m` would import it first
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
    lines: list[str] = []
    ready = threading.Event()

    def collect() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if "listening on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=collect, daemon=True).start()
    ready.wait(300)
    try:
        start = next(line for line in lines if "listening on" in line)
        base = start.split("listening on ")[1].split("/ ")[0]
        windows = asyncio.run(hostile.under_attack(
            base, proc.pid, attacks_for(base, seconds, names),
            caller_s=len(names) * (seconds + 10) + 120))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return windows, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, action="append",
                        help="a checkout to serve from (repeatable; default: this one)")
    parser.add_argument("--window", type=float, default=12.0, help="seconds of each attack")
    parser.add_argument("--attacks", default=f"{ISSUE},{BEYOND},{OLDER}")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--serve-args", default="--max-sessions 8",
                        help="options for serve beyond the model and the port")
    args = parser.parse_args()
    from conftest import golden_model_folder

    trees = args.tree or [ROOT]
    names = args.attacks.split(",")
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = golden_model_folder(Path(scratch) / "tiny")
        for round_ in range(args.rounds):
            for tree in trees:
                began = os.getloadavg()[0]
                windows, lines = run_tree(tree, model, Path(scratch), args.window, names,
                                          args.serve_args.split())
                print(f"\n== {tree} (round {round_ + 1}; load {began:.2f} -> "
                      f"{os.getloadavg()[0]:.2f})")
                print(next((line for line in lines if "listening on" in line), "no start"))
                print(hostile.HEADER)
                for window in windows:
                    print(window.row())
                traces = sum("Traceback" in line for line in lines)
                sends = sum("socket.send() raised" in line for line in lines)
                print(f"server stderr: {len(lines)} lines, {traces} tracebacks, {sends} "
                      "'socket.send() raised exception.'", flush=True)


if __name__ == "__main__":
    main()
