"""Echo cancellation candidates side by side: does the caller survive, is the echo removed?

In-process, 24 kHz, 80 ms frames as talk feeds them; the assistant (the far end) speaks
all along, the caller joins for 3 s. Candidates:

- "AEC3": WebRTC AEC3 through pywebrtc-audio, its output always (what talk did before);
- "livekit": livekit's rtc.AudioProcessingModule (the other binding), when installed;
  it takes no more settings than on/off, as pywebrtc-audio: no transparent mode or
  suppressor tuning to try;
- "ours": live.echo.EchoCanceller, AEC3 behind EchoPathDetector (the microphone as it is
  until an echo path is found).

Prints, per scene: the caller's level in the output (the part a short filter of the
caller explains, in dB against the caller itself; goal >= -3), and with an echo path the
echo's reduction while the caller is silent after the first 2 s (goal >= 20 dB).

Run: python bench/echo_paths.py     (about a minute on 2 CPU cores)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from live_signals import voice  # noqa: E402

from personaplex_cli.live.echo import EchoCanceller  # noqa: E402

SR = 24000
F = 1920
SECONDS = 14


def room(far: np.ndarray, gain: float, bulk_ms: float = 40.0) -> np.ndarray:
    y = np.zeros_like(far)
    for ms, g in ((0, 1.0), (5, 0.5), (15, 0.3)):
        d = int((bulk_ms + ms) * SR / 1000)
        y[d:] += gain * g * far[:len(far) - d]
    return y


def caller_db(caller: np.ndarray, out: np.ndarray, a: float, b: float) -> float:
    i, j = int(a * SR), int(b * SR)
    x = caller[i:j].astype(np.float64)
    lag = max(range(480), key=lambda k: abs(np.dot(x, out[i + k:j + k])))
    y = out[i + lag:j + lag].astype(np.float64)
    taps = np.stack([np.roll(x, k) for k in range(-8, 9)], 1)[8:-8]
    coef, *_ = np.linalg.lstsq(taps, y[8:-8], rcond=None)
    fit = taps @ coef
    return 10 * np.log10(np.dot(fit, fit) / np.dot(x[8:-8], x[8:-8]))


def energy(x: np.ndarray, a: float, b: float) -> float:
    seg = x[int(a * SR):int(b * SR)].astype(np.float64)
    return float(np.dot(seg, seg))


class _AlwaysFound:
    found = True
    echo_alone = False
    lag_ms = None

    def add(self, near, reference):
        pass


def aec3(mic: np.ndarray, far: np.ndarray) -> np.ndarray:
    ec = EchoCanceller(SR)
    ec.detector = _AlwaysFound()
    return np.concatenate([ec.process(mic[i:i + F], far[i:i + F])
                           for i in range(0, len(mic), F)])


def ours(mic: np.ndarray, far: np.ndarray) -> np.ndarray:
    ec = EchoCanceller(SR)
    return np.concatenate([ec.process(mic[i:i + F], far[i:i + F])
                           for i in range(0, len(mic), F)])


def livekit_apm(mic: np.ndarray, far: np.ndarray) -> np.ndarray:
    from livekit import rtc

    apm = rtc.AudioProcessingModule(echo_cancellation=True)
    block, out = SR // 100, []

    def frame(x):
        pcm = (np.clip(x, -1, 1) * 32767).astype(np.int16).tobytes()
        return rtc.AudioFrame(pcm, SR, 1, block)

    for i in range(0, len(mic), block):
        apm.process_reverse_stream(frame(far[i:i + block]))
        near = frame(mic[i:i + block])
        apm.process_stream(near)
        out.append(np.frombuffer(bytes(near.data), np.int16).astype(np.float32) / 32767)
    return np.concatenate(out)


def main() -> None:
    candidates = {"AEC3": aec3, "ours": ours}
    try:
        import livekit  # noqa: F401

        candidates["livekit"] = livekit_apm
    except ImportError:
        print("livekit is not installed: its column is left out (pip install livekit)")
    n = SECONDS * SR
    rng = np.random.default_rng(3)
    hiss = (1e-4 * rng.standard_normal(n)).astype(np.float32)
    speech = voice(SECONDS, 130, 3.0, seed=1, peak=0.5)
    fars = {"speech": speech, "loud noise": (0.3 * rng.standard_normal(n)).astype(np.float32),
            "quiet noise": (0.01 * rng.standard_normal(n)).astype(np.float32)}
    print(f"{'scene':44s}" + "".join(f"{name:>18s}" for name in candidates))
    for start in (1, 5, 9):
        caller = np.zeros(n, np.float32)
        caller[start * SR:(start + 3) * SR] = voice(3, 220, 3.7, seed=2, peak=0.3)
        for name, far in fars.items():
            cells = [f"{caller_db(caller, run(caller + hiss, far), start, start + 3):+.1f} dB"
                     for run in candidates.values()]
            print(f"{f'no echo, far {name}, caller {start}-{start + 3} s':44s}"
                  + "".join(f"{c:>18s}" for c in cells))
        for gain in (0.2, 0.5):
            echo = room(speech, gain)
            cells = []
            for run in candidates.values():
                out = run(caller + echo + hiss, speech)
                kept = caller_db(caller, out, start, start + 3)
                quiet = [(a, b) for a, b in ((2.0, start), (start + 3.5, SECONDS)) if b - a > 1]
                erle = min(10 * np.log10(energy(echo, a, b) / energy(out, a, b))
                           for a, b in quiet)
                cells.append(f"{kept:+.1f} / {erle:.0f} dB")
            print(f"{f'echo {gain}, caller {start}-{start + 3} s (caller / ERLE)':44s}"
                  + "".join(f"{c:>18s}" for c in cells))


if __name__ == "__main__":
    main()
