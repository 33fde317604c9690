"""`personaplex serve` under load: N real-time callers against a local server, over NVIDIA's
WebSocket protocol, OpenAI's Realtime protocol, or both side by side.

For each protocol and each N, a fresh `personaplex serve --max-sessions N` (a subprocess:
the callers' codecs and sockets do not share its interpreter) and N callers, each streaming
speech at real-time pace for --seconds, all at once:
- `nvidia`: `/api/chat`, a 40 ms Ogg Opus page per message, as the browser sends;
- `realtime`: `/v1/realtime` through the `openai` package's own client (`realtime.connect`),
  80 ms of PCM16 in base64 JSON per `input_audio_buffer.append`, as a voice agent sends.
From the server's /metrics: the engine's step time p50/p99 over the run. From each caller:
the assistant frames it got (nvidia: of the frames it sent; realtime: the frames of the
model's responses, as no audio is sent between them), and its lag: how far assistant frame
k of a run of frames (the call; one response) arrived behind the run's first + k x 80 ms.
What each frame cost the caller: bytes on the wire and the time to turn them back into PCM
(Opus decoding; JSON parsing and base64 decoding). A caller is held in real time when its
lag p99 stayed under 0.5 s (nvidia: and it got at least 95% of its frames).

Models: `tiny` (the golden test checkpoints), `mid` (full-size Mimi and a random LM of dim
1024 x 8, as bench/reply.py), or a model folder. Run:
    python bench/serve.py [--protocol nvidia,realtime] [--model tiny|mid|DIR]
                          [--callers 1,2,4,8] [--seconds 10]
Needs the test extra (the `openai` client; `openai[realtime]` for its websockets) and, for
`mid`, `pip install --no-deps moshi==0.2.13`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from serve_clients import PAGE_SAMPLES, call, speech  # noqa: E402

FRAME_S = 0.08
FRAME = 1920
HELD_FRAMES = 0.95
HELD_LAG_S = 0.5
PROTOCOLS = ("nvidia", "realtime")
ROLE = "Be brief."
# The Realtime events that carry the assistant's audio: GA's name, and beta's.
AUDIO_DELTAS = ("response.output_audio.delta", "response.audio.delta")


def model_folder(kind: str, root: Path) -> Path:
    if kind == "tiny":
        from conftest import golden_model_folder as golden

        return golden(root / "tiny")
    if kind == "mid":
        import reference

        sys.path.insert(0, str(ROOT / "bench"))
        from reply import MID_LM, TOKENIZER

        folder = root / "mid"
        folder.mkdir()
        reference.build_mimi(folder, seed=1)
        reference.build_lm(folder, reference.tiny_lm_kwargs(**MID_LM), seed=2)
        (folder / "tokenizer_spm_32k_3.model").symlink_to(TOKENIZER)
        return folder
    return Path(kind)


class Server:
    """`personaplex serve` in a subprocess, until `stop()`."""

    def __init__(self, model: Path, sessions: int, device: str, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NO_COLOR": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "personaplex_cli", "serve", "--model", str(model),
             "--device", device, "--port", "0", "--max-sessions", str(sessions),
             "--max-per-client", "0", "--voice", "", "--prompt", "Be brief."],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = None
        ready = threading.Event()

        def collect():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                found = re.search(r"listening on (http://\S+?)/ ", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=collect, daemon=True).start()
        ready.wait(600)
        if self.url is None:
            raise SystemExit("the server did not start:\n" + "\n".join(self.lines))

    def metric(self, name: str) -> float | None:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        found = re.search(rf"^personaplex_{re.escape(name)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Got:
    """What one caller got, whatever the protocol."""

    def __init__(self):
        self.runs: list[list[float]] = []  # arrival times of assistant frames, per run
        self.sent = 0  # 80 ms frames the caller sent
        self.wire_bytes = 0  # what its assistant frames took on the wire
        self.decode_s = 0.0  # turning them back into PCM

    @property
    def frames(self) -> int:
        return sum(len(run) for run in self.runs)

    def lags(self) -> np.ndarray:
        """Each frame's delay behind its run's first frame + k x 80 ms, less the least
        (a run that began late says nothing of the engine)."""
        lag = np.concatenate([np.asarray(run) - run[0] - FRAME_S * np.arange(len(run))
                              for run in self.runs if run] or [np.zeros(0)])
        return lag - lag.min() if len(lag) else lag


async def nvidia_caller(url: str, seconds: float, seed: int) -> Got:
    from serve_clients import Call

    result: Call = await call(url.replace("http", "ws", 1) + f"/api/chat?text_seed={seed}",
                              speech(seconds, seed=seed), linger_s=0.3)
    got = Got()
    got.runs = [result.audio_times]
    got.sent = round(result.sent_pages * PAGE_SAMPLES / FRAME)
    got.wire_bytes = sum(1 + len(page) for page in result.pages)
    began = time.perf_counter()
    result.pcm()  # the Opus decoding a client does
    got.decode_s = time.perf_counter() - began
    return got


async def realtime_caller(url: str, seconds: float, seed: int) -> Got:
    """One call through the openai SDK's realtime client, unchanged."""
    from openai import AsyncOpenAI

    got = Got()
    pcm = np.round(np.clip(speech(seconds, seed=seed), -1, 1) * 32767).astype("<i2")
    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0)
    async with client.realtime.connect(model="personaplex") as connection:
        await connection.session.update(session={
            "type": "realtime", "instructions": ROLE, "personaplex": {"seed": seed}})
        async for event in connection:
            if event.type == "error":
                raise SystemExit(f"the server refused the call: {event.error.message}")
            if event.type == "session.updated":
                break
        runs: dict[str, list[float]] = {}

        async def receive() -> None:
            async for event in connection:
                if event.type not in AUDIO_DELTAS:
                    continue
                runs.setdefault(event.response_id, []).append(time.monotonic())
                # What a client does with each frame: the event's JSON, then its base64.
                text = event.model_dump_json()
                began = time.perf_counter()
                json.loads(text)
                base64.b64decode(event.delta)
                got.decode_s += time.perf_counter() - began
                got.wire_bytes += len(text)

        reader = asyncio.create_task(receive())
        began = time.monotonic()
        for k in range(len(pcm) // FRAME):
            delay = began + k * FRAME_S - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await connection.input_audio_buffer.append(
                audio=base64.b64encode(pcm[k * FRAME:(k + 1) * FRAME].tobytes()).decode())
            got.sent += 1
        await asyncio.sleep(0.3)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    got.runs = list(runs.values())
    return got


CALLERS = {"nvidia": nvidia_caller, "realtime": realtime_caller}


async def load(url: str, protocol: str, callers: int, seconds: float) -> list[Got]:
    return await asyncio.gather(*[CALLERS[protocol](url, seconds, i)
                                  for i in range(callers)])


def has_realtime(url: str) -> bool:
    """Whether the server takes a WebSocket at /v1/realtime."""
    import websockets

    async def probe() -> bool:
        try:
            async with websockets.connect(url.replace("http", "ws", 1)
                                          + "/v1/realtime?model=personaplex",
                                          open_timeout=30):
                return True
        except websockets.InvalidStatus as refused:
            # Starlette answers a WebSocket to no route with 403 (this probe sends no
            # Origin to be refused for); 401 is a route that wants the token.
            return refused.response.status_code not in (403, 404)

    return asyncio.run(probe())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", default="nvidia,realtime",
                        help="nvidia, realtime, or both: nvidia,realtime")
    parser.add_argument("--model", default="tiny", help="tiny, mid, or a model folder")
    parser.add_argument("--callers", default="1,2,4,8")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    protocols = args.protocol.split(",")
    if any(p not in PROTOCOLS for p in protocols):
        parser.error(f"--protocol takes {' or '.join(PROTOCOLS)}, or both")
    with tempfile.TemporaryDirectory() as folder:
        model = model_folder(args.model, Path(folder))
        print(f"model {args.model}, device {args.device}, {args.threads} threads, "
              f"{args.seconds:g} s per caller")
        print(f"{'protocol':>8}  {'N':>3}  {'step p50':>8}  {'step p99':>8}  {'frames':>7}  "
              f"{'lag p50':>8}  {'lag p99':>8}  {'B/frame':>7}  {'µs/frame':>8}  "
              f"{'held':>5}  server's warm-up")
        most = {}
        for n in (int(x) for x in args.callers.split(",")):
            for protocol in protocols:
                server = Server(model, n, args.device, args.threads)
                try:
                    if protocol == "realtime" and not has_realtime(server.url):
                        print(f"{protocol:>8}  this server has no /v1/realtime: skipped")
                        continue
                    warm = next((line for line in server.lines
                                 if line.startswith("warm-up:")), "")
                    results = asyncio.run(load(server.url, protocol, n, args.seconds))
                    p50 = server.metric('step_seconds{quantile="0.5"}')
                    p99 = server.metric('step_seconds{quantile="0.99"}')
                finally:
                    server.stop()
                print(row(protocol, n, results, p50, p99, warm))
                held = sum(is_held(protocol, got) for got in results)
                if held == n:
                    most[protocol] = n
        print("most callers held in real time: " + ", ".join(
            f"{protocol} {most.get(protocol, 0)}" for protocol in protocols)
              + " (frames: nvidia, the least any caller got of the frames it sent; "
              "realtime, the fewest frames of responses any caller got; lag: the median "
              "caller's p50, the worst caller's p99)")


def is_held(protocol: str, got: Got) -> bool:
    lag = got.lags()
    late = float(np.percentile(lag, 99)) if len(lag) else float("inf")
    share = got.frames / max(got.sent, 1)
    return late <= HELD_LAG_S and (protocol != "nvidia" or share >= HELD_FRAMES)


def row(protocol: str, n: int, results: list[Got], p50, p99, warm: str) -> str:
    lag50, lag99 = [], []
    for got in results:
        lag = got.lags()
        lag50.append(float(np.percentile(lag, 50)) if len(lag) else float("inf"))
        lag99.append(float(np.percentile(lag, 99)) if len(lag) else float("inf"))
    frames = sum(got.frames for got in results)
    if protocol == "nvidia":
        shown = f"{100 * min(g.frames / max(g.sent, 1) for g in results):6.0f}%"
    else:
        shown = f"{min(g.frames for g in results):7d}"
    held = sum(is_held(protocol, got) for got in results)
    per_frame = sum(g.wire_bytes for g in results) / max(frames, 1)
    cost = 1e6 * sum(g.decode_s for g in results) / max(frames, 1)
    return (f"{protocol:>8}  {n:>3}  {1000 * (p50 or 0):6.1f}ms  {1000 * (p99 or 0):6.1f}ms  "
            f"{shown}  {1000 * statistics.median(lag50):6.0f}ms  {1000 * max(lag99):6.0f}ms  "
            f"{per_frame:7.0f}  {cost:8.0f}  {held:>2}/{n:<2}  "
            f"{warm.removeprefix('warm-up: ')}")


if __name__ == "__main__":
    main()
