"""What talk needs of this machine: PortAudio, default input and output devices at a rate
they share (through live/devices.py), and the echo canceller (live/echo.py)."""

from __future__ import annotations

from ..core.config import SAMPLE_RATE
from ..errors import EXIT_AUDIO_DEVICE
from .check import FAIL, OK, WARN, Check


def check_audio() -> list[Check]:
    """PortAudio, then the default input and output devices (through live/devices.py)."""
    from ..live.devices import (choose_samplerate, import_sounddevice, list_devices,
                                 resolve_device)
    from ..errors import AudioDeviceError

    try:
        sd = import_sounddevice()
    except AudioDeviceError as error:
        return [Check("portaudio", FAIL, error.message.split(";")[0],
                      "install PortAudio, e.g. apt install libportaudio2 (talk needs it)"
                      if "PortAudio" in error.message else
                      "pip install sounddevice (talk needs it)", EXIT_AUDIO_DEVICE),
                Check("audio-devices", WARN, "not checked without PortAudio",
                      "install PortAudio first")]
    portaudio = str(sd.get_portaudio_version()[1]).split(",")[0]  # less the git revision
    checks = [Check("portaudio", OK, f"{portaudio} (sounddevice {sd.__version__})")]
    no_device_fix = ("talk needs a microphone and a speaker: connect them, or start a sound "
                     "server (PipeWire, PulseAudio); the file commands need neither")
    try:
        devices = {d.index: d for d in list_devices(sd)}
    except Exception as error:  # PortAudio errors while querying
        checks.append(Check("audio-devices", WARN, f"cannot list the audio devices ({error})",
                            no_device_fix))
        return checks
    if not devices:
        checks.append(Check("audio-devices", WARN, "no audio devices found", no_device_fix))
        return checks
    found, problems = [], []
    ends = {}
    for kind in ("input", "output"):
        try:
            index = resolve_device(None, kind, sd)
        except AudioDeviceError as error:
            problems.append(error.message)
            continue
        ends[kind] = index
        d = devices[index]
        found.append(f"{kind} #{index} {d.name} ({d.hostapi}, {d.default_samplerate:.0f} Hz)")
    detail = "; ".join(found + problems)
    if problems:
        checks.append(Check("audio-devices", WARN, detail, no_device_fix))
        return checks
    try:
        rate = choose_samplerate(ends["input"], ends["output"], sd=sd)
        detail += ("; 24 kHz directly" if rate == SAMPLE_RATE
                   else f"; runs at {rate} Hz (resampled to 24 kHz)")
    except AudioDeviceError as error:
        checks.append(Check("audio-devices", WARN, f"{detail}; {error.message}",
                            "choose other devices with --input-device/--output-device"))
        return checks
    checks.append(Check("audio-devices", OK, detail))
    return checks


def check_echo_canceller() -> Check:
    """The library live/echo.py cancels echo with (pywebrtc-audio), by making one canceller."""
    from ..errors import EchoCancellerMissing

    try:
        from ..live.echo import EchoCanceller

        EchoCanceller(SAMPLE_RATE)
    except EchoCancellerMissing:
        return Check("echo-cancel", WARN, "pywebrtc-audio is not installed: talk cannot "
                     "cancel the speaker's echo",
                     "pip install pywebrtc-audio, or use headphones with talk --no-echo-cancel")
    except Exception as error:
        return Check("echo-cancel", WARN, f"pywebrtc-audio does not work here "
                     f"({type(error).__name__}: {error})",
                     "reinstall it (pip install --force-reinstall pywebrtc-audio), or use "
                     "headphones with talk --no-echo-cancel")
    try:
        from importlib.metadata import version

        text = f"pywebrtc-audio {version('pywebrtc-audio')}"
    except Exception:
        text = "pywebrtc-audio"
    return Check("echo-cancel", OK, f"{text} (WebRTC AEC3, for talk on speakers)")
