"""EchoCanceller (WebRTC AEC3 through pywebrtc-audio) on synthetic echo paths, no hardware."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fail_import
from live_signals import voice

from personaplex_cli.errors import EXIT_AUDIO_DEVICE
from personaplex_cli.live.echo import EchoCanceller, EchoPathDetector
from personaplex_cli.errors import EchoCancellerMissing
from personaplex_cli.live.jitter import InputQueue, OutputJitterBuffer

SR = 24000
F = 1920


def room(far: np.ndarray, bulk_ms: float = 0.0, taps=((30, .5), (35, .3), (45, .2))) -> np.ndarray:
    """A loudspeaker-to-microphone path: a few reflections a few tens of ms apart."""
    y = np.zeros_like(far)
    for ms, gain in taps:
        d = int((bulk_ms + ms) * SR / 1000)
        y[d:] += gain * far[:len(far) - d]
    return y


def energy(x: np.ndarray, start_s: float, end_s: float) -> float:
    seg = x[int(start_s * SR):int(end_s * SR)].astype(np.float64)
    return float(np.dot(seg, seg))


def explained_db(near: np.ndarray, out: np.ndarray, start_s: float, end_s: float) -> float:
    """Level of the part of `out` that a short FIR of `near` explains, relative to `near`:
    the caller's voice as it comes through, with residual echo left out (AEC3 delays its
    output ~9 ms and high-passes it, hence the lag search and the filter)."""
    a, b = int(start_s * SR), int(end_s * SR)
    x = near[a:b].astype(np.float64)
    lag = max(range(480), key=lambda k: abs(np.dot(x, out[a + k:b + k])))
    y = out[a + lag:b + lag].astype(np.float64)
    taps = np.stack([np.roll(x, k) for k in range(-8, 9)], 1)[8:-8]
    coef, *_ = np.linalg.lstsq(taps, y[8:-8], rcond=None)
    fit = taps @ coef
    return 10 * np.log10(np.dot(fit, fit) / np.dot(x[8:-8], x[8:-8]))


def run(ec: EchoCanceller, mic: np.ndarray, far: np.ndarray) -> np.ndarray:
    return np.concatenate([ec.process(mic[i:i + F], far[i:i + F]) for i in range(0, len(mic), F)])


def run_showing(ec: EchoCanceller, mic: np.ndarray, far: np.ndarray):
    """(the output, the echo reduction figure after each frame)"""
    out, shown = [], []
    for i in range(0, len(mic), F):
        out.append(ec.process(mic[i:i + F], far[i:i + F]))
        shown.append(ec.echo_reduction_db)
    return np.concatenate(out), shown


@pytest.fixture(scope="module")
def scene():
    """14 s: the assistant talks all along, the caller joins from 9 to 12 s (double talk)."""
    n = 14 * SR
    far = voice(14, 130, 3.0, seed=1, peak=0.5)
    near = np.zeros(n, np.float32)
    near[9 * SR:12 * SR] = voice(3, 220, 3.7, seed=2, peak=0.3)
    noise = (1e-4 * np.random.default_rng(3).standard_normal(n)).astype(np.float32)
    return far, near, noise


@pytest.mark.parametrize("bulk_ms", [0, 200])
def test_echo_is_cancelled_after_convergence(scene, bulk_ms):
    far, near, noise = scene
    echo = room(far, bulk_ms)
    ec = EchoCanceller(SR, delay_ms=bulk_ms)
    out = run(ec, echo + noise, far)
    erle = 10 * np.log10(energy(echo, 4, 14) / energy(out, 4, 14))
    assert erle > 20, f"ERLE {erle:.1f} dB"
    assert ec.echo_reduction_db is not None and ec.echo_reduction_db > 20


def test_a_wrong_reference_does_not_cancel(scene):
    """Control for the ERLE test: an unrelated far-end reference is no echo path (the
    microphone passes as it is), so the figure above is cancellation, not muting."""
    far, _, noise = scene
    echo = room(far, 200)
    other = voice(14, 130, 3.0, seed=7, peak=0.5)
    out = run(EchoCanceller(SR, delay_ms=200), echo + noise, other)
    assert 10 * np.log10(energy(echo, 4, 14) / energy(out, 4, 14)) < 12


@pytest.mark.parametrize("bulk_ms", [0, 200])
def test_near_speech_survives_double_talk(scene, bulk_ms):
    far, near, noise = scene
    echo = room(far, bulk_ms)
    ec = EchoCanceller(SR, delay_ms=bulk_ms)
    out, shown = run_showing(ec, echo + near + noise, far)
    level = 10 * np.log10(energy(out, 9, 12) / energy(near, 9, 12))
    assert -4.5 < level < 2, f"caller level changed by {level:+.1f} dB during double talk"
    kept = explained_db(near, out, 9, 12)
    assert kept >= -3, f"the caller came through at {kept:+.1f} dB"
    # What the view shows is the echo's reduction, the caller's voice left out: it stays
    # where it was before the caller joined (it fell to 1-5 dB when it counted the caller).
    before = 10 * np.log10(energy(echo, 6, 9) / energy(out, 6, 9))
    during = [x for x in shown[9 * SR // F:12 * SR // F] if x is not None]
    assert ec.echo_path and during and np.median(during) > before - 12, (before, during)
    # and the echo is still gone once the caller stops
    erle = 10 * np.log10(energy(echo, 12.5, 14) / energy(out, 12.5, 14))
    assert erle > 20, f"ERLE after double talk {erle:.1f} dB"


@pytest.mark.parametrize("far_end", ["speech", "loud noise", "quiet noise"])
def test_the_caller_passes_while_there_is_no_echo_path(scene, far_end):
    """Headphones, or speakers the microphone does not hear: the assistant speaks from the
    start and the caller speaks over it from second 1. AEC3 alone took the caller down to
    -22 to -34 dB here (it assumes an echo until it has learned otherwise, for ~8 s); no
    echo path is found, so the caller keeps their level, and no echo reduction is shown
    (it showed the caller removed as echo removed)."""
    far, _, noise = scene
    rng = np.random.default_rng(5)
    far = {"speech": far, "loud noise": 0.3 * rng.standard_normal(len(far)),
           "quiet noise": 0.01 * rng.standard_normal(len(far))}[far_end].astype(np.float32)
    caller = np.zeros(8 * SR, np.float32)
    caller[SR:4 * SR] = voice(3, 220, 3.7, seed=2, peak=0.3)
    ec = EchoCanceller(SR, delay_ms=300)
    out, shown = run_showing(ec, caller + noise[:len(caller)], far[:len(caller)])
    kept = explained_db(caller, out, 1, 4)
    assert kept >= -3, f"the caller came through at {kept:+.1f} dB"
    assert not ec.echo_path and shown == [None] * len(shown)


def test_the_echo_path_is_found_within_seconds_and_lost_without_echo(scene):
    """Laptop speakers: found within 2 s of the assistant speaking alone; then headphones
    plugged in (the echo stops): lost again within the detector's LOST_S, and the caller
    passes as it is once more."""
    far, _, noise = scene
    echo = room(far, 100)
    cut = 4 * SR
    mic = np.concatenate([echo[:cut], np.zeros(len(far) - cut, np.float32)]) + noise
    ec = EchoCanceller(SR, delay_ms=100)
    found = []
    for i in range(0, len(mic), F):
        ec.process(mic[i:i + F], far[i:i + F])
        found.append(ec.echo_path)
    first = found.index(True) * F / SR
    lost = (cut // F + found[cut // F:].index(False)) * F / SR
    assert first < 2.0 and all(found[int(first * SR / F):cut // F])
    assert lost - cut / SR < EchoPathDetector.LOST_S + 1.5 and not found[-1]


def test_near_speech_alone_passes_unchanged(scene):
    _, near, noise = scene
    silent = np.zeros_like(near)
    ec = EchoCanceller(SR)
    out = run(ec, near + noise, silent)
    assert abs(10 * np.log10(energy(out, 9, 12) / energy(near, 9, 12))) < 1
    assert ec.echo_reduction_db is None  # the far end was silent: nothing to show


def test_full_duplex_pipeline_pairs_the_far_reference_by_position():
    """Jitter buffer + input queue + echo canceller as `talk` wires them, with a simulated
    device: what the callback hands out reaches the mic 3 + 2 frames later through a room."""
    n_frames = 150  # 12 s
    far_src = voice(n_frames * F / SR, 130, 3.0, seed=4, peak=0.5)
    out_buf = OutputJitterBuffer(SR, capacity_ms=480)
    in_q = InputQueue(F, max_frames=4, sample_rate=SR)
    spoken = np.zeros(n_frames * F, np.float32)  # what left the speaker, on the callback's clock
    device_delay = 5 * F  # output latency 3 frames + input latency 2 frames = 400 ms
    ec = EchoCanceller(SR, delay_ms=1000 * device_delay / SR)
    cleaned, echoes = [], []
    outdata = np.zeros((F, 1), np.float32)
    for k in range(n_frames):
        out_buf.push(far_src[k * F:(k + 1) * F])  # the model's frame for this step
        out_buf.pull_into(outdata[:, 0])  # the callback: output first, then input
        spoken[k * F:(k + 1) * F] = outdata[:, 0]
        heard = room(spoken, bulk_ms=device_delay / SR * 1000)[k * F:(k + 1) * F]
        in_q.push(heard)
        frame, pos = in_q.get_nowait()
        cleaned.append(ec.process(frame, out_buf.played(pos, F)))
        echoes.append(frame)
    cleaned, echoes = np.concatenate(cleaned), np.concatenate(echoes)
    erle = 10 * np.log10(energy(echoes, 5, 12) / energy(cleaned, 5, 12))
    assert erle > 20, f"ERLE {erle:.1f} dB"


def test_long_delays_need_the_delay_estimate(scene):
    """AEC3 alone finds bulk delays up to ~450 ms; beyond that only the delay line (driven by
    the caller's estimate) brings the reference close enough (e.g. Bluetooth speakers)."""
    far, _, noise = scene
    echo = room(far, bulk_ms=800)
    with_estimate = run(EchoCanceller(SR, delay_ms=830), echo + noise, far)
    without = run(EchoCanceller(SR, delay_ms=0), echo + noise, far)
    assert 10 * np.log10(energy(echo, 4, 14) / energy(with_estimate, 4, 14)) > 20
    assert 10 * np.log10(energy(echo, 4, 14) / energy(without, 4, 14)) < 15


def test_the_delay_line_follows_a_jump(scene):
    """PulseAudio shifts output against input by a whole block after a late callback; the
    caller's estimate (PortAudio's timestamps) jumps with it and so does the reference."""
    far, _, noise = scene
    jump = 7 * SR
    echo = np.concatenate([room(far, 200)[:jump], room(far, 280)[jump:]])
    ec = EchoCanceller(SR, delay_ms=230)
    out = []
    for i in range(0, len(far), F):
        if i >= jump:
            ec.delay_ms = 310
        out.append(ec.process(echo[i:i + F] + noise[i:i + F], far[i:i + F]))
    out = np.concatenate(out)
    assert ec.reference_delay_ms == pytest.approx(250)
    # AEC3 alone needs a few seconds to find the new delay (~15 dB meanwhile).
    erle = 10 * np.log10(energy(echo, 7.2, 9.5) / energy(out, 7.2, 9.5))
    assert erle > 25, f"ERLE just after the jump {erle:.1f} dB"


def test_delay_estimate_and_reset():
    ec = EchoCanceller(SR, delay_ms=300)
    assert ec.delay_ms == 300 and ec.reference_delay_ms == pytest.approx(240)  # 60 ms margin
    ec.delay_ms = 312  # a wobble: the delay line stays put
    assert ec.delay_ms == 312 and ec.reference_delay_ms == pytest.approx(240)
    ec.delay_ms = 330  # a real move (> 20 ms from the applied 300)
    assert ec.reference_delay_ms == pytest.approx(270)
    ec.delay_ms = 30  # below the margin: no delay line, AEC3 aligns by itself
    assert ec.reference_delay_ms == 0
    for bad in (-1, 2500):
        with pytest.raises(ValueError):
            ec.delay_ms = bad
    far = voice(3, 130, 3.0, seed=1, peak=0.5)
    run(ec, room(far), far)
    assert ec.echo_path and ec.echo_reduction_db is not None
    ec.reset()
    assert ec.delay_ms == 30 and ec.echo_reduction_db is None and not ec.echo_path


def test_frame_shape_errors():
    ec = EchoCanceller(SR)
    with pytest.raises(ValueError, match="10 ms"):
        ec.process(np.zeros(1000, np.float32), np.zeros(1000, np.float32))
    with pytest.raises(ValueError, match="differ"):
        ec.process(np.zeros(F, np.float32), np.zeros(240, np.float32))
    assert ec.process(np.zeros(240, np.float64), np.zeros(240)).dtype == np.float32
    with pytest.raises(ValueError, match="too long"):
        ec.process(np.zeros(SR * 3, np.float32), np.zeros(SR * 3, np.float32))
    with pytest.raises(ValueError):
        EchoCanceller(22050)


def test_other_rates_work():
    ec = EchoCanceller(48000)
    assert ec.process(np.zeros(3840, np.float32), np.zeros(3840, np.float32)).shape == (3840,)


def test_missing_library_names_the_switch(monkeypatch):
    fail_import(monkeypatch, "pywebrtc_audio", ImportError("No module named 'pywebrtc_audio'"))
    with pytest.raises(EchoCancellerMissing) as info:
        EchoCanceller(SR)
    assert "--no-echo-cancel" in info.value.message
    assert "\n" not in info.value.message
    assert info.value.exit_code == EXIT_AUDIO_DEVICE
