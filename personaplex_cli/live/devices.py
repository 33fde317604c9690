"""The sounddevice (PortAudio) side of `talk`: devices, rates, one full-duplex stream.

- `import_sounddevice()`: sounddevice, or an `AudioDeviceError` saying how to get PortAudio
  (the Linux wheels don't bundle it: `import sounddevice` raises OSError without it).
- `list_devices()` / `format_devices()` for `--list-devices`; `resolve_device()` for
  `--input-device` / `--output-device` (an index or a case-insensitive name substring).
- `choose_samplerate()`: 24 kHz when the devices accept it, else one they all do (the
  caller then resamples with `rates.RateAdapter`).
- `DuplexStream`: ONE `sd.Stream` whose callback only pulls the output from an
  `OutputJitterBuffer` and pushes the input into an `InputQueue`, plus a `CallbackWatchdog`:
  when the sound server dies PortAudio stops calling back without any error, so a reader
  would otherwise wait forever. With one side only (a speaker, or a microphone), the same
  object over an output or input stream: a machine needs only the device it uses.

Every failure is an `AudioDeviceError` (exit 4) with a one-line message.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from ..clib import c_stderr_muted
from ..core.config import SAMPLE_RATE
from ..errors import AudioDeviceError
from .jitter import (ASSISTANT_QUEUE_MS, InputQueue, InputStats, OutputJitterBuffer,
                     OutputStats)

PORTAUDIO_MISSING = "PortAudio library not found; install it, e.g. apt install libportaudio2"


def import_sounddevice():
    """The sounddevice module; imported on first use (it loads PortAudio, ~0.15 s)."""
    try:
        import sounddevice
    except OSError as e:  # the Python package is there, the C library is not
        raise AudioDeviceError(PORTAUDIO_MISSING) from e
    except ImportError as e:
        raise AudioDeviceError("the sounddevice package is not installed (pip install sounddevice)") from e
    return sounddevice


def refresh_devices() -> None:
    """Make PortAudio look for devices again (it only does at initialisation).

    `_terminate`/`_initialize` are sounddevice's documented way to re-scan; no stream may be
    open. Tests need it after starting a sound server; the CLI normally does not.
    """
    sd = import_sounddevice()
    sd._terminate()
    sd._initialize()


def _pa_message(e: Exception) -> str:
    # PortAudioError args are (text, code[, host info]); keep the text, on one line.
    text = e.args[0] if e.args else str(e)
    return " ".join(str(text).split())


# -- listing and lookup -------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    hostapi: str
    max_input_channels: int
    max_output_channels: int
    default_samplerate: float
    is_default_input: bool
    is_default_output: bool


def _defaults(sd) -> tuple[int, int]:
    d_in, d_out = sd.default.device
    return int(d_in if d_in is not None else -1), int(d_out if d_out is not None else -1)


def list_devices(sd=None) -> list[DeviceInfo]:
    """Every device PortAudio sees (an empty list when there is none)."""
    sd = sd or import_sounddevice()
    d_in, d_out = _defaults(sd)
    apis = sd.query_hostapis()
    out = []
    for d in sd.query_devices():
        api = d.get("hostapi", 0)
        out.append(DeviceInfo(
            index=int(d["index"]), name=str(d["name"]),
            hostapi=str(apis[api]["name"]) if 0 <= api < len(apis) else "?",
            max_input_channels=int(d["max_input_channels"]),
            max_output_channels=int(d["max_output_channels"]),
            default_samplerate=float(d["default_samplerate"]),
            is_default_input=int(d["index"]) == d_in, is_default_output=int(d["index"]) == d_out))
    return out


def format_devices(devices: list[DeviceInfo]) -> str:
    """Plain-text table for `--list-devices`; `>` default input, `<` default output, `*` both."""
    if not devices:
        return "no audio devices found (is a sound server such as PulseAudio running?)"
    lines = ["    #  in  out   rate  name"]
    for d in devices:
        mark = ("*" if d.is_default_input and d.is_default_output else
                ">" if d.is_default_input else "<" if d.is_default_output else " ")
        lines.append(f"{mark} {d.index:3d} {d.max_input_channels:3d} {d.max_output_channels:4d}"
                     f" {d.default_samplerate:6.0f}  {d.name} ({d.hostapi})")
    return "\n".join(lines)


def resolve_device(spec: int | str | None, kind: str, sd=None) -> int:
    """Device index for `--input-device` / `--output-device` (`kind` "input" or "output").

    None, "" or "default" is the system default; an integer (or digits) an index; anything
    else a case-insensitive substring of the name (an exact name wins over substrings).
    """
    if kind not in ("input", "output"):
        raise ValueError(f"kind must be 'input' or 'output', got {kind!r}")
    sd = sd or import_sounddevice()
    devices = list_devices(sd)
    channels = (lambda d: d.max_input_channels) if kind == "input" else (lambda d: d.max_output_channels)
    usable = [d for d in devices if channels(d) > 0]
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "default")):
        d_in, d_out = _defaults(sd)
        index = d_in if kind == "input" else d_out
        match = [d for d in usable if d.index == index]
        if match:
            return index
        if not usable:
            raise AudioDeviceError(
                f"no {kind} device found (is a sound server such as PulseAudio running?"
                " --list-devices shows what PortAudio sees)")
        raise AudioDeviceError(f"no default {kind} device; choose one with --{kind}-device"
                               " (see --list-devices)")
    text = str(spec).strip()
    if isinstance(spec, int) or text.lstrip("-").isdigit():
        index = int(text)
        match = [d for d in devices if d.index == index]
        if not match:
            raise AudioDeviceError(f"no audio device #{index} (see --list-devices)")
        if channels(match[0]) == 0:
            raise AudioDeviceError(f"audio device #{index} ({match[0].name}) has no {kind}")
        return index
    needle = text.lower()
    exact = [d for d in usable if d.name.lower() == needle]
    found = exact or [d for d in usable if needle in d.name.lower()]
    if not found:
        raise AudioDeviceError(f"no {kind} device matches {text!r} (see --list-devices)")
    if len(found) > 1:
        names = ", ".join(f"#{d.index} {d.name}" for d in found[:5])
        raise AudioDeviceError(f"{kind} device {text!r} is ambiguous ({names}): give its index")
    return found[0].index


def choose_samplerate(input_device: int | None, output_device: int | None,
                      preferred: int = SAMPLE_RATE, sd=None) -> int:
    """A rate the devices accept for mono float32 (None: that side is not used):
    `preferred` if possible (no resampling), else the input's own rate, the output's, then
    48000, 44100, 32000, 16000.

    Only rates with whole 10 ms blocks qualify (the echo canceller works in 10 ms blocks).
    """
    sd = sd or import_sounddevice()
    own = []
    for index in (input_device, output_device):
        if index is None:
            continue
        try:
            own.append(int(round(float(sd.query_devices(index)["default_samplerate"]))))
        except Exception:  # a device that can't even be queried fails below anyway
            pass
    tried, first_error = [], None
    for rate in [preferred, *own, 48000, 44100, 32000, 16000]:
        if rate in tried or rate <= 0 or rate % 100:
            continue
        tried.append(rate)
        try:
            if input_device is not None:
                sd.check_input_settings(device=input_device, channels=1, dtype="float32",
                                        samplerate=rate)
            if output_device is not None:
                sd.check_output_settings(device=output_device, channels=1, dtype="float32",
                                         samplerate=rate)
            return rate
        except Exception as e:  # sd.PortAudioError, or ValueError for a bad device
            first_error = first_error or e
    if input_device is not None and output_device is not None:
        who = "the audio devices accept"
    else:
        who = f"the {'input' if input_device is not None else 'output'} device accepts"
    raise AudioDeviceError(
        f"{who} none of the sample rates {', '.join(map(str, tried))} Hz for mono audio"
        f" ({_pa_message(first_error) if first_error else 'no rate to try'})")


# -- the watchdog -------------------------------------------------------------------------

class CallbackWatchdog:
    """Notices when audio callbacks stop arriving (a dead sound server stops them silently).

    The callback calls `beat()`; the reading thread calls `check()`, which raises an
    `AudioDeviceError` once no callback came for `timeout_s` (or, before the first one,
    `startup_s`: a device may take a moment to start).
    """

    def __init__(self, timeout_s: float = 1.0, startup_s: float = 3.0, clock=time.monotonic):
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self._clock = clock
        self._armed_at: float | None = None
        self.last_beat: float | None = None
        self.beats = 0
        self.max_interval = 0.0

    def arm(self) -> None:
        """Start watching (call right before starting the stream)."""
        self._armed_at = self._clock()
        self.last_beat = None
        self.beats = 0
        self.max_interval = 0.0

    def beat(self) -> None:
        now = self._clock()
        if self.last_beat is not None and now - self.last_beat > self.max_interval:
            self.max_interval = now - self.last_beat
        self.last_beat = now
        self.beats += 1

    def silent_for(self) -> float:
        """Seconds since the last callback (since arming if none came yet)."""
        since = self.last_beat if self.last_beat is not None else self._armed_at
        return 0.0 if since is None else self._clock() - since

    def check(self) -> None:
        if self._armed_at is None:
            return
        silent = self.silent_for()
        if self.last_beat is None:
            if silent > self.startup_s:
                raise AudioDeviceError(
                    f"the audio device did not start: no audio callback in {silent:.1f} s")
        elif silent > self.timeout_s:
            raise AudioDeviceError(
                f"audio stopped: no audio callback for {silent:.1f} s"
                " (the device or the sound server went away)")


# -- the full-duplex stream ---------------------------------------------------------------

@dataclass(frozen=True)
class DuplexStats:
    samplerate: int
    blocksize: int
    latency: tuple[float, float]  # PortAudio's (input, output) estimate, seconds
    callbacks: int
    expected_callbacks: int  # from the time since start and the block duration
    max_interval_ms: float  # longest gap between two callbacks
    input_overflows: int  # status flags the callback saw
    input_underflows: int
    output_underflows: int
    output_overflows: int
    input: InputStats
    output: OutputStats


SIDES = ("duplex", "input", "output")


class DuplexStream:
    """One full-duplex mono float32 `sd.Stream` at the chosen rate, one frame per callback.

    The callback (PortAudio's thread) pulls `blocksize` samples from `output` and pushes the
    captured ones into `input`, counts status flags and beats the watchdog; nothing else.
    The inference thread calls `read()` for mic frames (with their positions), `write()` for
    the model's audio and `played(pos, n)` for the echo canceller's far-end reference.
    Positions and frames are at `samplerate`, which is 24 kHz unless a device refused it.

    `sides` "output" opens the speaker only: its callback pushes silence into `input`, so
    `read()` still ticks once a frame on the sound card's clock. "input" opens the
    microphone only: nothing is played, `played()` is silence. The device of a side not
    opened is None and is never looked up.
    """

    def __init__(self, input_device: int | str | None = None, output_device: int | str | None = None,
                 *, sides: str = "duplex", samplerate: int | None = None,
                 frame_ms: float = 80.0,
                 latency: str | float = "high", input_frames: int = 4,
                 output_capacity_ms: float = ASSISTANT_QUEUE_MS, prefill_ms: float = 0.0,
                 watchdog_s: float = 1.0, startup_s: float = 3.0):
        if sides not in SIDES:
            raise ValueError(f"sides must be one of {SIDES}, got {sides!r}")
        sd = import_sounddevice()
        self._sd = sd
        self.sides = sides
        self.input_device = (resolve_device(input_device, "input", sd)
                             if sides != "output" else None)
        self.output_device = (resolve_device(output_device, "output", sd)
                              if sides != "input" else None)
        self.samplerate = int(samplerate or choose_samplerate(self.input_device, self.output_device, sd=sd))
        self.blocksize = int(round(self.samplerate * frame_ms / 1000))
        self.frame_ms = frame_ms
        self.input = InputQueue(self.blocksize, input_frames, self.samplerate)
        self.output = OutputJitterBuffer(self.samplerate, output_capacity_ms, prefill_ms,
                                         record_ms=max(2000.0, (input_frames + 2) * frame_ms * 2))
        self.watchdog = CallbackWatchdog(watchdog_s, startup_s)
        self.input_overflows = self.input_underflows = 0
        self.output_underflows = self.output_overflows = 0
        self.callback_error: BaseException | None = None
        self._io_delay = 0.0
        self._started_at: float | None = None
        self._closed = False
        self._released = False
        self._muted = None  # the C stderr mute, held while the stream runs
        self._silence = np.zeros(self.blocksize, np.float32)  # an output-only stream's input
        if sides == "duplex":
            kind, device, callback = sd.Stream, (self.input_device, self.output_device), \
                self._callback
            what = f"the audio devices (#{self.input_device} in, #{self.output_device} out)"
        elif sides == "input":
            kind, device, callback = sd.InputStream, self.input_device, self._input_callback
            what = f"the input device #{self.input_device}"
        else:
            kind, device, callback = sd.OutputStream, self.output_device, self._output_callback
            what = f"the output device #{self.output_device}"
        try:
            self._stream = kind(samplerate=self.samplerate, blocksize=self.blocksize,
                                device=device, channels=1, dtype="float32", latency=latency,
                                callback=callback)
        except Exception as e:  # sd.PortAudioError, ValueError
            raise AudioDeviceError(
                f"cannot open {what} at {self.samplerate} Hz: {_pa_message(e)}") from e

    # PortAudio's thread. Order matters: the output is recorded before the input frame
    # becomes visible, so `played(pos, n)` is complete when a reader gets the frame at `pos`.
    def _callback(self, indata, outdata, frames, time_info, status) -> None:
        """One block of both sides; `indata` or `outdata` is None for a side not open."""
        self.watchdog.beat()
        try:
            if indata is not None and outdata is not None:
                # When this block will be heard minus when its input was captured: the
                # device part of the echo delay, as PortAudio knows it (0.0 where a host
                # API can't tell).
                self._io_delay = time_info.outputBufferDacTime - time_info.inputBufferAdcTime
            if status:
                self.input_overflows += bool(status.input_overflow)
                self.input_underflows += bool(status.input_underflow)
                self.output_underflows += bool(status.output_underflow)
                self.output_overflows += bool(status.output_overflow)
            if outdata is not None:
                self.output.pull_into(outdata[:, 0])
            # Without a microphone, silence: the clock of `read()`.
            self.input.push(indata[:, 0] if indata is not None else self._silence[:frames])
        except Exception as e:  # an exception would stop the stream with only a stderr print
            self.callback_error = e
            if outdata is not None:
                outdata.fill(0)

    def _output_callback(self, outdata, frames, time_info, status) -> None:
        self._callback(None, outdata, frames, time_info, status)

    def _input_callback(self, indata, frames, time_info, status) -> None:
        self._callback(indata, None, frames, time_info, status)

    # -- control --------------------------------------------------------------------------
    def start(self) -> DuplexStream:
        self.watchdog.arm()
        # PortAudio and ALSA print their own "Expression ... failed" lines on the C stderr
        # when a device or the sound server goes away; the user gets our one line instead.
        self._muted = c_stderr_muted.held()
        self._muted.__enter__()
        try:
            self._stream.start()
        except Exception as e:
            raise AudioDeviceError(f"cannot start the audio stream: {_pa_message(e)}") from e
        # Only now: the engine's thread, already running, calls check() while PortAudio
        # starts, and an inactive stream before this point is one still starting (ALSA's
        # start can take a while), not one that ended by itself.
        self._started_at = time.monotonic()
        return self

    def close(self, timeout: float = 2.0) -> bool:
        """Stop at once (queued output is not played) and release the devices; idempotent.

        Returns False when PortAudio did not let go within `timeout` s: a sound server that
        hangs (measured with a SIGSTOPped PulseAudio) blocks `abort()` and also PortAudio's
        own exit handler, so the caller should then leave with `os._exit()` after printing
        its error, or the process never ends.
        """
        if self._closed:
            return self._released
        self._closed = True
        self.input.close()

        def release():
            for step in (self._stream.abort, self._stream.close):
                try:
                    step()
                except Exception:  # a device that went away: nothing left to stop
                    pass

        worker = threading.Thread(target=release, name="portaudio-close", daemon=True)
        worker.start()
        worker.join(timeout)
        self._released = not worker.is_alive()
        if self._released and self._muted is not None:  # a hung PortAudio may still print
            self._muted.__exit__(None, None, None)
            self._muted = None
        return self._released

    def __enter__(self) -> DuplexStream:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self) -> None:
        """Raise `AudioDeviceError` if the stream failed: callbacks stopped, or one raised."""
        if self.callback_error is not None:
            raise AudioDeviceError(f"the audio callback failed: {self.callback_error}")
        self.watchdog.check()
        # PortAudio also marks the stream inactive when its device breaks (measured with a
        # killed PulseAudio), sometimes before the watchdog's timeout.
        if self._started_at is not None and not self._closed and not self._stream.active:
            raise AudioDeviceError("audio stopped: the audio stream ended by itself"
                                   " (the device or the sound server went away)")

    # -- the inference side ---------------------------------------------------------------
    def read(self, timeout: float | None = None, poll_s: float = 0.1) -> tuple[np.ndarray, int] | None:
        """Next mic frame and its position; None after `timeout` seconds or once closed.

        Waits in slices of `poll_s` and checks the watchdog between them, so a dead device
        ends in an `AudioDeviceError` about `watchdog_s` after its last callback, not a hang.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
            got = self.input.get(wait)
            if got is not None or self._closed:
                return got
            self.check()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def write(self, samples: np.ndarray) -> None:
        """Queue the model's audio (at `samplerate`) for playback."""
        self.output.push(samples)

    def played(self, pos: int, n: int) -> np.ndarray:
        """What went to the speaker at positions [pos, pos + n): the far-end reference."""
        return self.output.played(pos, n)

    @property
    def latency(self) -> tuple[float, float]:
        """PortAudio's (input, output) latency estimate in seconds; 0.0 for a side not open."""
        lat = self._stream.latency
        if isinstance(lat, (tuple, list)):
            return float(lat[0]), float(lat[1])
        return (float(lat), 0.0) if self.sides == "input" else (0.0, float(lat))

    @property
    def echo_delay_ms(self) -> float:
        """Echo delay estimate for `EchoCanceller.delay_ms`: from a sample handed to the
        output until it is captured again, for a far reference taken from `played()`.

        From PortAudio's timestamps in the latest callback (output DAC time minus input ADC
        time; the jitter buffer plays no part, since `played()` records what left it). On
        PulseAudio they said 230-238 ms where the loopback's echo came 278 ms late (its own
        40 ms included), and followed the delay when it jumped by a block. `latency` is no
        substitute: it claimed 0.16 + 0.24 s, and an estimate that is too high puts the
        reference after its echo. So 0.0 (let AEC3 search) when the timestamps are missing.
        """
        if 0.0 < self._io_delay < 2.0:
            return 1000.0 * self._io_delay
        return 0.0

    def stats(self) -> DuplexStats:
        elapsed = 0.0 if self._started_at is None else time.monotonic() - self._started_at
        return DuplexStats(
            self.samplerate, self.blocksize, self.latency, self.watchdog.beats,
            int(elapsed * self.samplerate / self.blocksize), 1000.0 * self.watchdog.max_interval,
            self.input_overflows, self.input_underflows, self.output_underflows,
            self.output_overflows, self.input.stats(), self.output.stats())
