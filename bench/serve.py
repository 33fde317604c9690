"""`personaplex serve` under load: N real-time WebSocket callers against a local server.

For each N, a fresh `personaplex serve --max-sessions N` (a subprocess: the callers' Opus
and sockets do not share its interpreter) and N callers, each streaming speech at real-time
pace (a 40 ms Ogg Opus page per message, as the browser) for --seconds, all at once. From
the server's /metrics: the engine's step time p50/p99 over the run. From each caller: the
assistant frames it got of the frames it sent, and its lag: when assistant frame k arrived,
against when it was due (handshake + k x 80 ms), less the caller's smallest lag (network
and start-up are not the engine's). A caller is held in real time when it got at least 95%
of its frames and its lag p99 stayed under 0.5 s. Prints the table and the most callers
held in real time.

Models: `tiny` (the golden test checkpoints), `mid` (full-size Mimi and a random LM of dim
1024 x 8, as bench/reply.py), or a model folder. Run:
    python bench/serve.py [--model tiny|mid|DIR] [--callers 1,2,4,8] [--seconds 10]
Needs the test extra and, for `mid`, `pip install --no-deps moshi==0.2.13`.
"""

from __future__ import annotations

import argparse
import asyncio
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
HELD_FRAMES = 0.95
HELD_LAG_S = 0.5


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


def lags(times: list[float], handshake_at: float) -> np.ndarray:
    due = handshake_at + FRAME_S * np.arange(1, len(times) + 1)
    lag = np.asarray(times) - due
    return lag - lag.min() if len(lag) else lag


async def load(url: str, callers: int, seconds: float):
    began = time.monotonic()
    results = await asyncio.gather(*[
        call(url.replace("http", "ws", 1) + f"/api/chat?text_seed={i}",
             speech(seconds, seed=i), linger_s=0.3) for i in range(callers)])
    return began, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, mid, or a model folder")
    parser.add_argument("--callers", default="1,2,4,8")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = model_folder(args.model, Path(folder))
        print(f"model {args.model}, device {args.device}, {args.threads} threads, "
              f"{args.seconds:g} s per caller")
        print(f"{'N':>3}  {'step p50':>8}  {'step p99':>8}  {'frames':>7}  {'lag p50':>8}  "
              f"{'lag p99':>8}  {'held':>5}  server's warm-up")
        most = 0
        for n in (int(x) for x in args.callers.split(",")):
            server = Server(model, n, args.device, args.threads)
            try:
                warm = next((line for line in server.lines if line.startswith("warm-up:")), "")
                began, results = asyncio.run(load(server.url, n, args.seconds))
                p50 = server.metric('step_seconds{quantile="0.5"}')
                p99 = server.metric('step_seconds{quantile="0.99"}')
            finally:
                server.stop()
            shares, lag50, lag99, held = [], [], [], 0
            for result in results:
                expected = result.sent_pages * PAGE_SAMPLES / 1920  # frames it sent
                shares.append(len(result.audio_times) / max(expected, 1))
                lag = lags(result.audio_times, began + result.handshake_s)
                lag50.append(float(np.percentile(lag, 50)) if len(lag) else float("inf"))
                lag99.append(float(np.percentile(lag, 99)) if len(lag) else float("inf"))
                held += shares[-1] >= HELD_FRAMES and lag99[-1] <= HELD_LAG_S
            if held == n:
                most = n
            print(f"{n:>3}  {1000 * p50:6.1f}ms  {1000 * p99:6.1f}ms  "
                  f"{100 * min(shares):6.0f}%  {1000 * statistics.median(lag50):6.0f}ms  "
                  f"{1000 * max(lag99):6.0f}ms  {held:>2}/{n:<2}  "
                  f"{warm.removeprefix('warm-up: ')}")
        print(f"most callers held in real time: {most} (frames: the least any caller got, of "
              f"the frames it sent; lag: the median caller's p50, the worst caller's p99)")


if __name__ == "__main__":
    main()
