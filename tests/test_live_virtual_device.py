"""The live path on a real (virtual) PulseAudio device: cadence, both signal paths, echo
cancellation through a speaker->mic loopback, a sound server dying mid-stream, no server.

Never skipped: the `virtual_audio` fixture fails when the device cannot be started.
Each stream test mimics `talk`'s loop: one frame written for each mic frame read.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile
from live_signals import SR, chirp, find, voice
from virtual_audio import VirtualAudio, virtual_audio  # noqa: F401  (the fixture)

from personaplex_cli.live.devices import (
    DuplexStream,
    format_devices,
    list_devices,
    resolve_device,
)
from personaplex_cli.live.echo import EchoCanceller
from personaplex_cli.errors import AudioDeviceError

F = 1920
REPO = Path(__file__).resolve().parents[1]


def run_loop(stream: DuplexStream, seconds: float, out_signal: np.ndarray | None = None,
             on_frame=None, lead: int = 3) -> tuple[np.ndarray, list[int], list[float]]:
    """Read mic frames for `seconds`, writing one frame of `out_signal` (then silence) per
    frame read, `lead` frames ahead (a cushion: on a busy 2-core machine this thread may
    wake up late, and a late frame would be an underrun). Returns (mic audio, frame
    positions, arrival times)."""
    mic, positions, arrivals = [], [], []
    written = 0

    def write_next():
        nonlocal written
        chunk = out_signal[written * F:(written + 1) * F]
        stream.write(np.pad(chunk, (0, F - len(chunk))))
        written += 1

    if out_signal is not None:
        for _ in range(lead):
            write_next()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = stream.read(timeout=2.0)
        assert got is not None, "no mic frame within 2 s"
        frame, pos = got
        arrivals.append(time.monotonic())
        mic.append(frame)
        positions.append(pos)
        if on_frame is not None:
            on_frame(frame, pos)
        if out_signal is not None:
            write_next()
    return np.concatenate(mic), positions, arrivals


def test_devices_are_listed_and_found(virtual_audio):
    infos = list_devices()
    names = [d.name for d in infos]
    assert "pulse" in names and "default" in names, names
    assert any(d.is_default_input for d in infos) and any(d.is_default_output for d in infos)
    assert "pulse" in format_devices(infos)
    pulse = names.index("pulse")
    assert resolve_device("PULSE", "input") == infos[pulse].index
    assert resolve_device(str(infos[pulse].index), "output") == infos[pulse].index
    with pytest.raises(AudioDeviceError, match="no input device matches"):
        resolve_device("no such card", "input")


def test_full_duplex_cadence(virtual_audio):
    stream = DuplexStream()
    assert (stream.samplerate, stream.blocksize) == (24000, 1920)  # no resampling needed
    with stream:
        _, positions, arrivals = run_loop(stream, 3.0, out_signal=np.zeros(0, np.float32))
        st = stream.stats()
    expected = st.expected_callbacks
    print(f"callbacks {st.callbacks}/{expected}, max interval {st.max_interval_ms:.1f} ms,"
          f" latency {st.latency}, flags in/out {st.input_overflows}/{st.output_underflows}")
    assert st.callbacks >= 0.95 * expected, st
    assert st.max_interval_ms < 250, st
    assert positions == [k * F for k in range(len(positions))]  # nothing dropped, in order
    assert len(arrivals) >= 0.95 * 3.0 / 0.08 - 2
    assert st.input.dropped_frames == 0
    assert all(0 < x < 1.0 for x in st.latency)


RECORDER_TRIES = 3


def test_played_audio_reaches_the_speaker(virtual_audio, tmp_path):
    """What the stream plays reaches the speaker sample for sample. The speaker's copy is
    taken by `parecord`, a process outside ours: on a machine that stalls (CI's run lost
    0.1 s of it once, correlation 0.88), its copy can miss samples the speaker got. So the
    whole playback is repeated, up to RECORDER_TRIES times, only while our own record of
    what was played is exact and the recorder's copy alone differs; every check of our
    stream holds on every try."""
    sig = chirp(1.0)
    out = np.concatenate([np.zeros(F * 3, np.float32), sig, np.zeros(F * 6, np.float32)])
    for attempt in range(1, RECORDER_TRIES + 1):
        far = []  # the far-end reference, fetched per mic frame as the echo canceller does
        recorder = virtual_audio.record_speaker(tmp_path / f"speaker{attempt}.wav")
        try:
            time.sleep(0.3)
            with DuplexStream() as stream:
                run_loop(stream, len(out) / SR + 0.8, out_signal=out,
                         on_frame=lambda frame, pos: far.append(stream.played(pos, F)))
                st = stream.stats()
        finally:
            recorded, rate = soundfile.read(recorder.stop(), dtype="float32")
        far = np.concatenate(far)
        print(f"speaker, try {attempt}: output underruns {st.output.underruns}, "
              f"max callback gap {st.max_interval_ms:.0f} ms")
        # What the speaker got is exactly the record the echo canceller uses as its
        # reference (at position 3 * F unless the stream started with an underrun).
        assert rate == SR
        assert st.output.dropped_samples == 0
        far_off, far_ncc = find(far, sig)
        assert far_ncc > 0.99999 and far_off <= 4 * F
        np.testing.assert_array_equal(far[far_off:far_off + len(sig)], sig)
        try:
            off, ncc = find(recorded, sig)
            assert ncc > 0.999, ncc
            np.testing.assert_allclose(recorded[off:off + len(sig)], sig, atol=1e-6)
            shift = off - far_off
            n = min(len(far), len(recorded) - shift) - 1
            np.testing.assert_allclose(recorded[shift + 1000:shift + n], far[1000:n], atol=1e-6)
            return
        except AssertionError as error:
            if attempt == RECORDER_TRIES:
                raise
            print(f"speaker, try {attempt}: the recorder's copy differs ({str(error)[:80]})")


def test_echo_is_cancelled_on_the_device(virtual_audio):
    """A laptop-like echo (loopback speaker -> mic, 40 ms + buffering, -13 dB): the model's
    voice goes out, comes back through the 'room', and the canceller removes it."""
    speech = voice(8.0, 130, 3.0, seed=11, peak=0.5)
    virtual_audio.echo(40, 60)
    try:
        with DuplexStream() as stream:
            ec = EchoCanceller(stream.samplerate)
            cleaned, far, estimates, hints = [], [], [], []

            def cancel(frame, pos):  # as talk does it, with the estimate of the moment
                hints.append(stream.echo_delay_ms)
                ec.delay_ms = hints[-1]
                far.append(stream.played(pos, F))
                cleaned.append(ec.process(frame, far[-1]))
                estimates.append(ec.echo_reduction_db)

            mic, _, _ = run_loop(stream, 8.0, out_signal=speech, on_frame=cancel)
            latency, st = stream.latency, stream.stats()
    finally:
        virtual_audio.echo_off()
    cleaned, far = np.concatenate(cleaned), np.concatenate(far)
    delay, ncc = find(mic[SR:7 * SR], far[SR:6 * SR])
    # Per-second ERLE after the first seconds, while the speech goes on; the median, since
    # on a busy machine PulseAudio may shift the echo by a block (see echo.py) and AEC3
    # needs a moment to follow.
    per_second = [10 * np.log10(np.dot(mic[a:a + SR], mic[a:a + SR]) / np.dot(cleaned[a:a + SR], cleaned[a:a + SR]))
                  for a in range(2 * SR, len(mic) - SR, SR // 2)]
    erle = float(np.median(per_second))
    print(f"echo delay {delay / SR * 1000:.1f} ms (ncc {ncc:.3f}); estimate {hints[-1]:.1f} ms"
          f" (latency {latency}); ERLE per second {np.round(per_second, 1)} dB;"
          f" shown at the end {estimates[-1]}; underruns {st.output.underruns},"
          f" max callback gap {st.max_interval_ms:.0f} ms")
    assert ncc > 0.5, "no echo reached the microphone"
    # The estimate is PortAudio's device delay; the loopback adds its own 40 ms and a bit.
    # Compared with the estimates of the same seconds (PulseAudio may shift the output by a
    # block midway): an estimate up to 60 ms too high is what the canceller's margin covers.
    hint = float(np.median([h for h in hints[SR // F:7 * SR // F] if h > 0]))
    assert -60 < delay / SR * 1000 - hint < 80, (delay / SR * 1000, hint)
    assert erle > 20, f"median ERLE {erle:.1f} dB"
    shown = [e for e in estimates[-25:] if e is not None]  # what talk would display
    assert shown and float(np.median(shown)) > 15, shown


# -- failures, each in its own process --------------------------------------------------

_STREAM_UNTIL_ERROR = """
import json, os, time
from personaplex_cli.live.devices import DuplexStream
from personaplex_cli.errors import AudioDeviceError
def say(**event):
    print(json.dumps(event), flush=True)
stream = None
try:
    stream = DuplexStream(watchdog_s=1.0)
    stream.start()
    n = 0
    while True:
        got = stream.read(timeout=10)
        if got is None:
            say(event="timeout")
            break
        stream.write(got[0] * 0)
        n += 1
        if n == 10:
            say(event="ready")
except AudioDeviceError as e:
    t = time.monotonic()
    released = stream.close(timeout=2.0) if stream is not None else True
    say(event="error", t=t, message=e.message, code=e.exit_code, released=released)
    # A hung server also blocks PortAudio's exit handler: leave without it, as talk must.
    os._exit(4)
"""


@contextlib.contextmanager
def _spawn(env: dict) -> Iterator[tuple[subprocess.Popen, queue.Queue, list[str]]]:
    """Run the stream script; its JSON events go to the queue, anything else (PortAudio's
    own complaints on stderr) to the list, for failure messages. A script still running
    when the test is done is killed."""
    proc = subprocess.Popen([sys.executable, "-c", _STREAM_UNTIL_ERROR], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events: queue.Queue = queue.Queue()
    other: list[str] = []

    def pump():
        for line in proc.stdout:
            if line.startswith("{"):
                events.put(json.loads(line))
            else:
                other.append(line.rstrip())

    threading.Thread(target=pump, daemon=True).start()
    try:
        yield proc, events, other
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("failure", ["killed", "frozen"])
def test_a_dead_or_hung_sound_server_is_noticed(failure):
    """killed: PulseAudio dies (SIGKILL); PortAudio stops calling back and marks the stream
    inactive, without raising anything. frozen: it hangs (SIGSTOP); callbacks just stop, and
    only the watchdog can tell. Either way the reader gets an AudioDeviceError within a
    second or two instead of waiting forever, and the process can still exit."""
    va = VirtualAudio().start()  # a private server: this test breaks it
    try:
        with _spawn({**os.environ, **va.env}) as (proc, lines, other):
            first = lines.get(timeout=20)
            assert first["event"] == "ready", (first, other)
            va.kill_server() if failure == "killed" else va.freeze_server()
            broken = time.monotonic()
            event = lines.get(timeout=10)
            assert event["event"] == "error", (event, other)
            noticed = event["t"] - broken
            print(f"{failure}: noticed after {noticed:.2f} s, released {event['released']}:"
                  f" {event['message']}")
            assert noticed < 2.0
            assert event["message"].startswith("audio stopped") and "\n" not in event["message"]
            assert event["code"] == 4
            assert proc.wait(10) == 4
    finally:
        va.stop()


def test_no_sound_server_means_no_input_device(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULSE_")}
    env["PULSE_SERVER"] = f"unix:{tmp_path}/no-server.sock"  # nothing listens there
    env["PULSE_RUNTIME_PATH"] = str(tmp_path / "runtime")
    client_conf = tmp_path / "client.conf"
    client_conf.write_text("autospawn = no\n")  # and no daemon gets started on demand
    env["PULSE_CLIENTCONFIG"] = str(client_conf)
    if os.path.exists("/dev/snd"):  # a machine with a real card: hide it from ALSA too
        (tmp_path / "empty.conf").write_text("")
        env["ALSA_CONFIG_PATH"] = str(tmp_path / "empty.conf")
    with _spawn(env) as (proc, lines, other):
        event = lines.get(timeout=30)
        assert event["event"] == "error", (event, other)
        assert event["message"].startswith("no input device found"), event["message"]
        assert event["code"] == 4
        assert proc.wait(10) == 4
