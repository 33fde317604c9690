"""live/devices.py without hardware: device lookup, rate choice, the watchdog, PortAudio missing.

A fake sounddevice module stands in for PortAudio here; the real thing is exercised on the
virtual device in test_live_virtual_device.py.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from conftest import fail_import

from personaplex_cli.errors import EXIT_AUDIO_DEVICE
from personaplex_cli.live import devices
from personaplex_cli.live.devices import (
    CallbackWatchdog,
    choose_samplerate,
    format_devices,
    import_sounddevice,
    list_devices,
    resolve_device,
)
from personaplex_cli.errors import AudioDeviceError


class PortAudioError(Exception):
    pass


def fake_sd(devs, default=(-1, -1), rates=None):
    """A stand-in for the sounddevice module. `rates` maps device index -> accepted rates."""
    def query_devices(index=None):
        table = [dict(d, index=i) for i, d in enumerate(devs)]
        return table if index is None else table[index]

    def check(kind):
        def checker(device=None, channels=None, dtype=None, samplerate=None):
            d = devs[device]
            if d[f"max_{kind}_channels"] < (channels or 1):
                raise PortAudioError("Invalid number of channels")
            ok = (rates or {}).get(device)
            if ok is not None and samplerate not in ok:
                raise PortAudioError("Invalid sample rate [PaErrorCode -9997]")
        return checker

    return SimpleNamespace(
        query_devices=query_devices, query_hostapis=lambda: ({"name": "ALSA"},),
        default=SimpleNamespace(device=list(default)),
        check_input_settings=check("input"), check_output_settings=check("output"))


def dev(name, ins, outs, rate=48000.0):
    return {"name": name, "hostapi": 0, "max_input_channels": ins,
            "max_output_channels": outs, "default_samplerate": rate}


LAPTOP = [dev("HDA Intel PCH: ALC257 Analog (hw:0,0)", 2, 2, 44100.0),
          dev("USB Headset: Audio (hw:1,0)", 1, 2),
          dev("HDMI 0 (hw:0,3)", 0, 8),
          dev("pulse", 32, 32, 44100.0),
          dev("default", 32, 32, 44100.0)]


@pytest.fixture
def laptop():
    return fake_sd(LAPTOP, default=(4, 4))


def test_list_and_format(laptop):
    infos = list_devices(laptop)
    assert [d.index for d in infos] == [0, 1, 2, 3, 4]
    assert infos[4].is_default_input and infos[4].is_default_output
    assert infos[2].max_input_channels == 0 and infos[2].hostapi == "ALSA"
    text = format_devices(infos)
    assert "* " in text.splitlines()[-1] and "default (ALSA)" in text
    assert "USB Headset" in text and "44100" in text
    assert "no audio devices found" in format_devices([])


def test_resolve_default_index_and_name(laptop):
    assert resolve_device(None, "input", laptop) == 4
    assert resolve_device("default", "output", laptop) == 4
    assert resolve_device(1, "input", laptop) == 1
    assert resolve_device("1", "output", laptop) == 1
    assert resolve_device("usb", "input", laptop) == 1  # case-insensitive substring
    assert resolve_device("hdmi", "output", laptop) == 2
    assert resolve_device("PULSE", "input", laptop) == 3


def test_exact_name_beats_substring():
    sd = fake_sd([dev("pulse", 32, 32), dev("pulse monitor", 32, 32)], default=(0, 0))
    assert resolve_device("Pulse", "input", sd) == 0


@pytest.mark.parametrize("spec, kind, words", [
    ("hdmi", "input", "no input device matches 'hdmi'"),
    ("nothing", "output", "no output device matches"),
    ("hw:", "input", "ambiguous"),
    (2, "input", "has no input"),
    (9, "output", "no audio device #9"),
])
def test_resolve_errors(laptop, spec, kind, words):
    with pytest.raises(AudioDeviceError) as info:
        resolve_device(spec, kind, laptop)
    assert words in info.value.message and "\n" not in info.value.message
    assert info.value.exit_code == EXIT_AUDIO_DEVICE == 4


def test_no_devices_at_all_says_no_input_device():
    sd = fake_sd([], default=(-1, -1))
    with pytest.raises(AudioDeviceError, match="no input device found"):
        resolve_device(None, "input", sd)
    with pytest.raises(AudioDeviceError, match="no output device found"):
        resolve_device(None, "output", sd)


def test_no_default_but_devices():
    sd = fake_sd(LAPTOP[:2], default=(-1, -1))
    with pytest.raises(AudioDeviceError, match="--input-device"):
        resolve_device(None, "input", sd)


def test_rate_24k_when_accepted(laptop):
    assert choose_samplerate(1, 0, sd=laptop) == 24000


def test_rate_falls_back_to_the_devices_own():
    sd = fake_sd(LAPTOP, default=(4, 4), rates={0: {44100, 48000}, 1: {48000, 16000}})
    assert choose_samplerate(0, 0, sd=sd) == 44100  # the input's own rate
    assert choose_samplerate(1, 1, sd=sd) == 48000
    assert choose_samplerate(1, 0, sd=sd) == 48000  # the one both accept


def test_rate_skips_rates_without_whole_10ms_blocks():
    sd = fake_sd([dev("odd", 1, 1, 22050.0)], default=(0, 0), rates={0: {22050, 32000}})
    assert choose_samplerate(0, 0, sd=sd) == 32000


def test_no_common_rate():
    sd = fake_sd(LAPTOP, default=(4, 4), rates={0: {44100}, 1: {48000}})
    with pytest.raises(AudioDeviceError) as info:
        choose_samplerate(0, 1, sd=sd)
    assert "24000, 44100, 48000" in info.value.message and "Invalid sample rate" in info.value.message


def test_portaudio_missing(monkeypatch):
    fail_import(monkeypatch, "sounddevice", OSError("PortAudio library not found"))
    with pytest.raises(AudioDeviceError) as info:
        import_sounddevice()
    assert info.value.message == "PortAudio library not found; install it, e.g. apt install libportaudio2"


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_watchdog_startup_then_stall():
    clock = FakeClock()
    wd = CallbackWatchdog(timeout_s=1.0, startup_s=3.0, clock=clock)
    wd.check()  # not armed: nothing to watch
    wd.arm()
    clock.now += 2.5
    wd.check()  # still within the start-up grace
    clock.now += 1.0
    with pytest.raises(AudioDeviceError, match="did not start"):
        wd.check()
    wd.arm()
    for _ in range(5):
        clock.now += 0.08
        wd.beat()
    clock.now += 0.9
    wd.check()
    assert wd.beats == 5 and wd.max_interval == pytest.approx(0.08)
    clock.now += 0.2
    with pytest.raises(AudioDeviceError) as info:
        wd.check()
    assert "no audio callback for 1.1 s" in info.value.message
    assert wd.silent_for() == pytest.approx(1.1)


def test_module_imports_nothing_heavy():
    # live/ must stay importable without PortAudio, torch, typer or rich being loaded.
    import subprocess

    code = ("import sys, personaplex_cli.live.devices, personaplex_cli.live.echo,"
            " personaplex_cli.live.jitter, personaplex_cli.live.rates;"
            " print(sorted(m for m in ('sounddevice', 'pywebrtc_audio', 'soxr', 'torch', 'typer', 'rich')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert devices.SAMPLE_RATE == 24000


# -- DuplexStream with a fake PortAudio stream: the callback's contract -------------------

class FakeStream:
    def __init__(self, fail=None, kind="duplex", **kwargs):
        if fail:
            raise PortAudioError(fail)
        self.kind = kind
        self.kwargs = kwargs
        self.callback = kwargs["callback"]
        self.active = False
        self.latency = (0.16, 0.24) if kind == "duplex" else 0.16  # as sounddevice gives it
        self.closed = False

    def start(self):
        self.active = True

    def abort(self):
        self.active = False

    def close(self):
        self.closed = True


def fake_stream_sd(fail=None, devs=None, default=(1, 1)):
    sd = fake_sd(devs or [dev("pulse", 32, 32, 44100.0), dev("default", 32, 32, 44100.0)],
                 default=default)
    sd.Stream = lambda **kw: FakeStream(fail=fail, kind="duplex", **kw)
    sd.InputStream = lambda **kw: FakeStream(fail=fail, kind="input", **kw)
    sd.OutputStream = lambda **kw: FakeStream(fail=fail, kind="output", **kw)
    return sd


def status(**flags):
    """A stand-in for sounddevice's CallbackFlags: attributes, and false when none is set."""
    names = ("input_overflow", "input_underflow", "output_underflow", "output_overflow")
    return type("Status", (), {**{n: flags.get(n, False) for n in names},
                               "__bool__": lambda self: any(flags.values())})()


TIMES = SimpleNamespace(inputBufferAdcTime=10.0, outputBufferDacTime=10.2375, currentTime=10.08)


def test_stream_opens_one_full_duplex_mono_stream(monkeypatch):
    monkeypatch.setattr(devices, "import_sounddevice", lambda: fake_stream_sd())
    s = devices.DuplexStream()
    kw = s._stream.kwargs
    assert (kw["samplerate"], kw["blocksize"], kw["channels"], kw["dtype"]) == (24000, 1920, 1, "float32")
    assert kw["device"] == (1, 1)
    assert s.echo_delay_ms == 0.0  # no callback yet: no estimate
    s.start()
    assert s._stream.active
    assert s.close() is True and s._stream.closed
    assert s.close() is True  # idempotent


def test_a_stream_still_starting_has_not_ended(monkeypatch):
    """talk's engine thread runs before the stream starts and checks it meanwhile: while
    PortAudio's start has not returned, an inactive stream is one still starting."""
    checked = []

    class SlowStart(FakeStream):
        def start(self):
            stream.check()  # the engine's thread, while ALSA is still starting
            checked.append(True)
            self.active = True

    sd = fake_stream_sd()
    sd.Stream = lambda **kw: SlowStart(kind="duplex", **kw)
    monkeypatch.setattr(devices, "import_sounddevice", lambda: sd)
    stream = devices.DuplexStream()
    stream.start()
    assert checked and stream._stream.active
    stream.check()
    stream._stream.active = False  # and after it, inactive is ended
    with pytest.raises(AudioDeviceError, match="ended by itself"):
        stream.check()
    stream.close()


def test_stream_open_failure_is_an_audio_device_error(monkeypatch):
    monkeypatch.setattr(devices, "import_sounddevice",
                        lambda: fake_stream_sd(fail="Invalid sample rate [PaErrorCode -9997]"))
    with pytest.raises(AudioDeviceError) as info:
        devices.DuplexStream(samplerate=24000)
    assert info.value.message == (
        "cannot open the audio devices (#1 in, #1 out) at 24000 Hz: Invalid sample rate [PaErrorCode -9997]")


def test_callback_pairs_input_and_output_and_counts_flags(monkeypatch):
    import numpy as np

    monkeypatch.setattr(devices, "import_sounddevice", lambda: fake_stream_sd())
    s = devices.DuplexStream().start()
    cb = s._stream.callback
    outdata = np.full((1920, 1), 9.0, np.float32)
    mic = np.arange(1920 * 2, dtype=np.float32).reshape(-1, 1)
    s.write(np.full(1920, 0.5, np.float32))
    cb(mic[:1920], outdata, 1920, TIMES, status())
    assert (outdata == 0.5).all()
    cb(mic[1920:], outdata, 1920, TIMES, status(output_underflow=True, input_overflow=True))
    assert not outdata.any()  # nothing written: silence
    frames = [s.read(timeout=0.1) for _ in range(2)]
    assert [pos for _, pos in frames] == [0, 1920]
    np.testing.assert_array_equal(frames[1][0], mic[1920:, 0])
    assert (s.played(0, 1920) == 0.5).all() and not s.played(1920, 1920).any()
    st = s.stats()
    assert (st.callbacks, st.input_overflows, st.output_underflows, st.input_underflows) == (2, 1, 1, 0)
    assert st.output.underruns == 1
    assert s.echo_delay_ms == pytest.approx(237.5)
    s.close()


def test_one_side_opens_one_device_and_still_keeps_the_clock(monkeypatch):
    """A speaker without a microphone (`talk --input FILE`): an output stream whose
    callback pushes silence into the input queue, so that `read()` still ticks once a
    frame on the sound card's clock; a microphone without a speaker (`--output FILE`): an
    input stream. The missing side is never looked up."""
    import numpy as np

    speaker_only = [dev("HDMI", 0, 8, 48000.0)]
    mic_only = [dev("USB mic", 1, 0, 48000.0)]
    monkeypatch.setattr(devices, "import_sounddevice",
                        lambda: fake_stream_sd(devs=speaker_only, default=(-1, 0)))
    with pytest.raises(AudioDeviceError, match="no input device found"):
        devices.DuplexStream()
    s = devices.DuplexStream(sides="output", samplerate=24000).start()
    assert s._stream.kind == "output" and s.input_device is None and s.output_device == 0
    assert s._stream.kwargs["device"] == 0
    s.write(np.full(1920, 0.5, np.float32))
    outdata = np.zeros((1920, 1), np.float32)
    s._stream.callback(outdata, 1920, TIMES, status(output_underflow=True))
    assert (outdata == 0.5).all()
    frame, pos = s.read(timeout=0.1)
    assert pos == 0 and not frame.any()
    assert s.stats().output_underflows == 1 and s.latency == (0.0, 0.16)
    s.close()

    monkeypatch.setattr(devices, "import_sounddevice",
                        lambda: fake_stream_sd(devs=mic_only, default=(0, -1)))
    s = devices.DuplexStream(sides="input", samplerate=24000).start()
    assert s._stream.kind == "input" and s.output_device is None
    mic = np.arange(1920, dtype=np.float32).reshape(-1, 1)
    s._stream.callback(mic, 1920, TIMES, status(input_overflow=True))
    frame, pos = s.read(timeout=0.1)
    np.testing.assert_array_equal(frame, mic[:, 0])
    assert s.stats().input_overflows == 1 and not s.played(0, 1920).any()
    assert s.echo_delay_ms == 0.0  # no output: no echo delay
    s.close()


def test_a_failing_callback_is_reported_not_silent(monkeypatch):
    import numpy as np

    monkeypatch.setattr(devices, "import_sounddevice", lambda: fake_stream_sd())
    s = devices.DuplexStream().start()
    outdata = np.full((1000, 1), 9.0, np.float32)
    s._stream.callback(np.zeros((1000, 2, 2), np.float32), outdata, 1000, TIMES, status())
    assert not outdata.any()  # the speaker gets silence, not garbage
    with pytest.raises(AudioDeviceError, match="the audio callback failed"):
        s.read(timeout=0.3)
    s.close()


def test_read_raises_when_callbacks_stop(monkeypatch):
    import numpy as np

    monkeypatch.setattr(devices, "import_sounddevice", lambda: fake_stream_sd())
    s = devices.DuplexStream(watchdog_s=0.3, startup_s=0.3).start()
    with pytest.raises(AudioDeviceError, match="did not start"):
        s.read(timeout=5)
    s._stream.callback(np.zeros((1920, 1), np.float32), np.zeros((1920, 1), np.float32), 1920, TIMES, status())
    assert s.read(timeout=1) is not None
    with pytest.raises(AudioDeviceError, match="no audio callback for"):
        s.read(timeout=5)
    s.watchdog.beat()
    s._stream.active = False  # PortAudio gave up on the device, callbacks or not
    with pytest.raises(AudioDeviceError, match="ended by itself"):
        s.check()
    s.close()
