"""`personaplex talk`: a live conversation, microphone to speaker, with a live view.

parse -> open (devices checked, model loaded, persona primed, engine warmed up) -> run (one
full-duplex stream, the engine thread of live/engine.py, this thread drawing and watching)
-> report (a summary; the exit status).

Threads: PortAudio's callback only copies audio into and out of two bounded rings; the
engine thread reads a caller frame, cancels the echo, steps the model and queues the answer;
this (main) thread prints the inner monologue, draws the view, writes the stats each
second, and ends the session on Ctrl-C, at --duration, at the end of --input, or when the
engine fails (its exception is re-raised here, so the one error table reports it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from ..core.config import FRAME_SECONDS, FRAME_SIZE, SAMPLE_RATE
from ..errors import OutputError
from ..prompts.voices import DEFAULT_VOICE
from ..transcript import PAUSE_FRAMES, SILENT
from .files import check_input, check_output
from .options import (DEFAULT_MODEL, AudioTemperatureOpt, AudioTopKOpt, DeviceOpt, DtypeOpt,
                      ForceOpt, GreedyOpt, ModelOpt, PromptFileOpt, PromptOpt, Quantize,
                      QuantizeOpt, QuietOpt, SeedOpt, TemperatureOpt, TopKOpt, VerboseOpt,
                      VoiceOpt, role_text, sampling)
from .output import Output, console
from .persona import open_conversation

WARM_UP_FRAMES = 12
WARM_UP_MAX_S = 5.0  # a slow device measures fewer frames rather than stalling the start
STOP_WAIT_S = 0.15  # how long a stop waits for a step in progress (Ctrl-C: 200 ms in all)
CLOSE_WAIT_S = 1.0  # how long PortAudio may take to let go of the device
POLL_S = 0.05  # the main thread's heartbeat
FRAME_MS = 1000 * FRAME_SECONDS
QUEUE_CAPACITY_MS = 480.0  # assistant audio the speaker's buffer holds beyond --buffer
VIEW_HZ = 8
BAR = 24  # level bars, in characters, for -60..0 dBFS
SPEAKING_DBFS = -45.0  # louder than this counts as speaking
LINE_CHARS = 80  # a monologue line on stdout ends at the next word after this many


# -- options -----------------------------------------------------------------------------

def _device_names(kind: str):
    """Device names for shell completion (PortAudio is only loaded for this option)."""

    def complete(incomplete: str) -> list[str]:
        try:
            from ..live.devices import list_devices

            channels = f"max_{kind}_channels"
            names = [d.name for d in list_devices() if getattr(d, channels) > 0]
        except Exception:  # no PortAudio, no server: nothing to offer, never an error
            return []
        return [name for name in names if name.lower().startswith(incomplete.lower())]

    return complete


InputDeviceOpt = Annotated[str | None, typer.Option(
    "--input-device", metavar="INDEX|NAME", autocompletion=_device_names("input"),
    help="The microphone: an index or part of a name from --list-devices "
    "(default: the system's).")]
OutputDeviceOpt = Annotated[str | None, typer.Option(
    "--output-device", metavar="INDEX|NAME", autocompletion=_device_names("output"),
    help="The speaker: an index or part of a name from --list-devices "
    "(default: the system's).")]


def talk(
    voice: VoiceOpt = DEFAULT_VOICE,
    prompt: PromptOpt = None,
    prompt_file: PromptFileOpt = None,
    input_device: InputDeviceOpt = None,
    output_device: OutputDeviceOpt = None,
    list_devices: Annotated[bool, typer.Option(
        "--list-devices", help="List the audio devices (> input, < output, * both "
        "defaults) and exit.")] = False,
    record: Annotated[str | None, typer.Option(
        "--record", metavar="FILE",
        help="A stereo float32 24 kHz WAV of the session: left the caller as the model "
        "heard them (after echo cancellation), right the assistant, frame t of both from "
        "the same model step. Written in place as the session goes, not atomically; its "
        "header is updated every second, so even a killed session leaves a valid file.")
    ] = None,
    transcript: Annotated[str | None, typer.Option(
        "--transcript", metavar="FILE",
        help="The inner monologue, written as it comes: .json (a piece per frame), "
        ".srt/.vtt subtitles, else plain text.")] = None,
    stats: Annotated[str | None, typer.Option(
        "--stats", metavar="FILE",
        help="JSON lines, one a second: frames, dropped caller frames, underruns, "
        "overruns, buffer, compute p50/p99, real-time factor, echo reduction, callbacks.")
    ] = None,
    buffer: Annotated[float, typer.Option(
        "--buffer", metavar="MS", min=0.0, max=2000.0,
        help="Assistant audio kept waiting for the speaker beyond the frame it plays: "
        "absorbs slow frames and late callbacks, adds as much latency.")] = 80.0,
    no_echo_cancel: Annotated[bool, typer.Option(
        "--no-echo-cancel",
        help="Do not cancel the speaker's echo from the microphone (with headphones).")
    ] = False,
    input_file: Annotated[str | None, typer.Option(
        "--input", metavar="FILE",
        help="Play this recording as the caller, at real-time pace, instead of the "
        "microphone; the session ends with it.")] = None,
    output_file: Annotated[str | None, typer.Option(
        "--output", metavar="FILE",
        help="Write the assistant to this file as it comes (float32 WAV unless the suffix "
        "names another format) instead of playing it. With --input too, no audio device "
        "is used.")] = None,
    duration: Annotated[float | None, typer.Option(
        "--duration", metavar="SECONDS", min=0.1, help="End the session after this long.")
    ] = None,
    temperature: TemperatureOpt = 0.7,
    top_k: TopKOpt = 25,
    audio_temperature: AudioTemperatureOpt = 0.8,
    audio_top_k: AudioTopKOpt = 250,
    greedy: GreedyOpt = False,
    seed: SeedOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = Quantize.none,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Talk with the model live: it listens to the microphone and answers on the speaker.

    The inner monologue goes to stdout as it comes; the live view, hints and the summary
    to stderr. Echo cancellation is on, so laptop speakers work (--no-echo-cancel with
    headphones). Ctrl-C ends the session (exit 130); --duration, or the end of --input,
    ends it with exit 0. When the device is slower than real time, the oldest caller audio
    is dropped (and counted) so that latency stays bounded.

    Alignment: frame t of --record's two channels is the caller frame the model heard at
    step t and the assistant frame that step answered with (offset 0). So the recorded
    assistant equals `personaplex reply` on the recorded caller channel with the same
    --seed and options, frame for frame; dropped caller frames are not in the recording.
    Likewise --input FILE --output OUT equals `reply FILE OUT`, offset 0, while no frame
    is dropped.
    """
    out = Output(quiet, verbose)
    if list_devices:
        from ..live.devices import format_devices, list_devices as devices  # noqa: I001

        out.result(format_devices(devices()))
        return
    plan = _plan(record, transcript, stats, input_file, output_file, input_device,
                 output_device, force)
    role = role_text(prompt, prompt_file)
    if input_file is not None:
        from ..audio.io import open_audio

        open_audio(input_file).close()  # a bad recording fails before the model loads
    audio = None
    if plan.uses_device:
        audio = _Audio.find(input_device, output_device,
                            echo=not no_echo_cancel and plan.mic_and_speaker)
    how = sampling(temperature, top_k, audio_temperature, audio_top_k, greedy)
    conversation, device_name = _prepare(out, model, device, dtype, quantize, voice, role, how,
                                         seed)
    _run(out, plan, audio, conversation, device_name, voice, buffer, duration)


# -- plan: what the session reads and writes ---------------------------------------------

@dataclass
class _Plan:
    record: str | None
    transcript: str | None
    stats: str | None
    input_file: str | None
    output_file: str | None
    force: bool

    @property
    def uses_device(self) -> bool:
        return self.input_file is None or self.output_file is None

    @property
    def mic_and_speaker(self) -> bool:
        return self.input_file is None and self.output_file is None


def _plan(record, transcript, stats, input_file, output_file, input_device, output_device,
          force) -> _Plan:
    outputs = {"--record": record, "--transcript": transcript, "--stats": stats,
               "--output": output_file}
    for option, path in outputs.items():
        if path == "-":
            raise typer.BadParameter("stdout carries the inner monologue; name a file",
                                     param_hint=f"'{option}'")
    if input_file is not None and input_device is not None:
        raise typer.BadParameter("--input replaces the microphone; drop one of them",
                                 param_hint="'--input-device'")
    if output_file is not None and output_device is not None:
        raise typer.BadParameter("--output replaces the speaker; drop one of them",
                                 param_hint="'--output-device'")
    if input_file is not None:
        if input_file == "-":
            raise typer.BadParameter("the recording is played at its own pace: name a file",
                                     param_hint="'--input'")
        check_input(input_file)
    named = [p for p in outputs.values() if p is not None]
    if len({os.path.abspath(p) for p in named}) != len(named):
        raise OutputError("two outputs have the same name")
    inputs = (input_file,) if input_file is not None else ()
    for path in named:  # refused before anything loads, not after the model is up
        check_output(path, force=force, inputs=inputs)
    return _Plan(record, transcript, stats, input_file, output_file, force)


def _open_in_place(stack: contextlib.ExitStack, path: str, force: bool, binary: bool = True):
    """Opened for writing where it is (talk's files grow during the session: a reader can
    follow them, and a killed session leaves what was written), unlike the atomic outputs
    of the other commands. Devices and FIFOs work too."""
    check_output(path, force=force)  # again: it may have appeared while the model loaded
    try:  # entered into the caller's stack, which closes it
        handle = (open(path, "wb") if binary  # noqa: SIM115
                  else open(path, "w", encoding="utf-8", newline="\n"))  # noqa: SIM115
    except OSError as error:
        raise OutputError(f"cannot write {path}: {error.strerror or error}") from None
    return stack.enter_context(handle)


# -- audio devices, checked before the model loads ---------------------------------------

@dataclass
class _Audio:
    input: int
    output: int
    rate: int
    canceller: Any  # live.echo.EchoCanceller, or None

    @classmethod
    def find(cls, input_device: str | None, output_device: str | None, echo: bool) -> _Audio:
        from ..live.devices import choose_samplerate, import_sounddevice, resolve_device

        sd = import_sounddevice()
        index_in = resolve_device(input_device, "input", sd)
        index_out = resolve_device(output_device, "output", sd)
        rate = choose_samplerate(index_in, index_out, sd=sd)
        canceller = None
        if echo:
            from ..live.echo import EchoCanceller

            canceller = EchoCanceller(rate)
        return cls(index_in, index_out, rate, canceller)


# -- the model: load, persona, prime, warm up ----------------------------------------------

def _prepare(out: Output, model_spec: str, device: str, dtype, quantize, voice_spec: str,
             role: str, how, seed: int | None):
    conversation = open_conversation(out, model_spec, device, dtype, voice_spec, role, how,
                                     quantize=quantize)
    the_model = conversation.model
    conversation.start([seed])
    per_frame_ms = _warm_up(conversation)
    conversation.start([seed])  # a fresh conversation: the warm-up leaves no trace
    out.note(warm_up_line(per_frame_ms, the_model.device.type))
    return conversation, the_model.device.type


def _warm_up(conversation) -> float:
    """ms per frame, measured on silence (the first steps pay one-off costs: allocations,
    CUDA graph capture), so the stream's first frame does not stall."""
    import numpy as np

    silence = np.zeros((1, FRAME_SIZE), np.float32)
    times = []
    began = time.perf_counter()
    for _ in range(WARM_UP_FRAMES):
        t = time.perf_counter()
        conversation.step(silence)
        times.append(time.perf_counter() - t)
        if len(times) >= 3 and time.perf_counter() - began > WARM_UP_MAX_S:
            break
    steady = times[2:] if len(times) > 4 else times[-1:]
    return 1000.0 * statistics.median(steady)


def warm_up_line(per_frame_ms: float, device: str) -> str:
    rtf = per_frame_ms / FRAME_MS
    head = f"warm-up: {per_frame_ms:.0f} ms per 80 ms frame on {device} (real-time factor {rtf:.2f})"
    if rtf <= 0.7:
        return f"{head}: keeps up"
    if rtf <= 1.0:
        return f"{head}: keeps up, barely; on a busy machine some caller audio may be dropped"
    why = " (on a CPU the full-size model is far too slow; use a GPU)" if device == "cpu" else ""
    return (f"{head}: this device cannot keep up with the model in real time{why}; caller "
            "audio will be dropped to keep latency bounded")


# -- the inner monologue -------------------------------------------------------------------

class _Monologue:
    """The text pieces as they come: stdout (flushed per piece; a line ends after a pause,
    or at a word once it is LINE_CHARS long), the --transcript file, and the last lines for
    the view. A stdout that fails (a reader gone) is kept in `stdout_error`, for the main
    loop to end the session with, and no longer written."""

    def __init__(self, transcript, whole_lines: bool):
        self.transcript = transcript
        self.whole_lines = whole_lines  # under the live view: only complete lines on stdout
        self._line = ""
        self._quiet_frames = 0
        self.lines: list[str] = []
        self.stdout_error: OSError | None = None

    def add(self, index: int, piece: str) -> None:
        if self.transcript is not None:
            self.transcript.add(index, piece)
        if piece in SILENT:
            self._quiet_frames += 1
            if self._line and self._quiet_frames >= PAUSE_FRAMES:
                self._end_line()
            return
        self._quiet_frames = 0
        if len(self._line) >= LINE_CHARS and piece.startswith(" "):
            self._end_line()
        text = piece.lstrip() if not self._line else piece
        if text:
            self._line += text
            if not self.whole_lines:
                self._stdout(text)

    def drain(self, pieces) -> None:
        """Takes every (frame index, piece) the engine has queued so far."""
        while pieces:
            self.add(*pieces.popleft())

    def _end_line(self) -> None:
        self._stdout((self._line if self.whole_lines else "") + "\n")
        self.lines = (self.lines + [self._line])[-20:]
        self._line = ""

    def _stdout(self, text: str) -> None:
        if self.stdout_error is not None:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError as error:  # BrokenPipeError: the error table says so at the end
            self.stdout_error = error

    def tail(self, count: int) -> list[str]:
        """The last lines, the unfinished one included (read by the view's thread)."""
        return (self.lines + ([self._line] if self._line else []))[-count:]

    def close(self) -> None:
        if self.transcript is not None:
            self.transcript.close()
        if self._line:
            self._end_line()


# -- the live view -------------------------------------------------------------------------


def _bar(level: float):
    from rich.text import Text

    filled = round(BAR * min(1.0, max(0.0, (level + 60.0) / 60.0)))
    active = level > SPEAKING_DBFS
    text = Text("━" * filled, style="green" if active else "dim")
    text.append("─" * (BAR - filled), style="dim")
    text.append(f" {level:4.0f} dBFS" if level > -99 else "    silent")
    if active:
        text.append("  speaking", style="bold")
    return text


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def render_view(s, monologue: _Monologue, title: str, width: int):
    """The view as a rich renderable, from one `LiveStats`. Every line stays 3 columns
    short of the terminal: the terminal's echo of ^C after a full-width line pushes the
    view down a line, and rich's erase then leaves its first line behind."""
    from rich.constrain import Constrain
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True, min_width=9)
    grid.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
    minutes, seconds = divmod(int(s.elapsed_s), 60)
    grid.add_row("talk", Text(f"{minutes:02d}:{seconds:02d} · {title} · Ctrl-C ends",
                              style="dim"))
    grid.add_row("caller", _bar(s.caller_dbfs))
    grid.add_row("assistant", _bar(s.assistant_dbfs))
    room = max(20, width - 3 - 11)
    lines = [line if len(line) <= room else "…" + line[-room + 1:]
             for line in monologue.tail(3)]
    grid.add_row("monologue", Text("\n".join(lines) if lines else "…", style="italic"))
    rtf = "-" if s.rtf is None else f"{s.rtf:.2f}"
    grid.add_row("compute", f"{_ms(s.compute_p50_ms)} p50 · {_ms(s.compute_p99_ms)} p99 "
                            f"per 80 ms frame · real-time factor {rtf}")
    if s.buffer_ms is not None:
        grid.add_row("speaker", f"buffer {s.buffer_ms:.0f} ms · underruns {s.underruns} · "
                                f"overruns {s.overruns}")
    grid.add_row("caller in", f"dropped {s.dropped} · waiting {s.pending} · "
                              f"delay {_ms(s.delay_ms)}")
    if s.echo_delay_ms is not None:
        erle = "-" if s.echo_reduction_db is None else f"{s.echo_reduction_db:.0f} dB"
        grid.add_row("echo", f"reduced by {erle} (less while both speak) · "
                             f"delay {_ms(s.echo_delay_ms)}")
    return Constrain(grid, max(20, width - 3))


# -- the session ---------------------------------------------------------------------------

class _Files:
    """The session's outputs, opened in place right before it starts."""

    def __init__(self, stack: contextlib.ExitStack, plan: _Plan):
        from ..live.record import IncrementalWav

        self.record = self.output = self.transcript = self.stats = None
        if plan.record:
            self.record = IncrementalWav(_open_in_place(stack, plan.record, plan.force), 2)
        if plan.output_file:
            self.output = _open_writer(stack, plan.output_file, plan.force)
        if plan.transcript:
            from ..transcript import TranscriptWriter, format_of

            self.transcript = TranscriptWriter(
                _open_in_place(stack, plan.transcript, plan.force, binary=False),
                format_of(plan.transcript))
        if plan.stats:
            self.stats = _open_in_place(stack, plan.stats, plan.force, binary=False)

    def write_stats(self, line: dict) -> None:
        if self.stats is not None:
            self.stats.write(json.dumps(line) + "\n")
            self.stats.flush()

    def close(self) -> None:
        for writer in (self.record, self.output):
            if writer is not None:
                writer.close()


def _open_writer(stack: contextlib.ExitStack, path: str, force: bool):
    from ..audio.writers import format_of, open_writer
    from ..live.record import IncrementalWav

    handle = _open_in_place(stack, path, force)
    fmt = format_of(path) or "wav"
    if fmt == "wav":  # header kept true every second, as --record's
        return IncrementalWav(handle, 1)
    return open_writer(handle, fmt, SAMPLE_RATE, 1, "f32" if fmt == "raw" else "s16")


@dataclass
class _Session:
    engine: Any  # live.engine.Engine
    stream: Any  # live.devices.DuplexStream, or None
    files: _Files
    monologue: _Monologue
    title: str


def _open_session(stack: contextlib.ExitStack, out: Output, plan: _Plan,
                  audio: _Audio | None, conversation, title: str,
                  buffer_ms: float) -> _Session:
    from ..live.engine import (
        DeviceClock,
        DeviceMic,
        Engine,
        PacedClock,
        RecordingCaller,
        Speaker,
    )

    stream = adapter = None
    if audio is not None:  # opened (not started) first: a device error leaves no files
        from ..live.devices import DuplexStream

        # Playback starts once a frame more than --buffer waits: each callback takes a
        # frame, so only what waits beyond it cushions a slow step, or a late callback
        # followed by a catch-up one (a prefill of just --buffer would give no cushion).
        stream = DuplexStream(audio.input, audio.output, samplerate=audio.rate,
                              prefill_ms=buffer_ms + FRAME_MS,
                              output_capacity_ms=buffer_ms + FRAME_MS + QUEUE_CAPACITY_MS)
        stack.callback(stream.close, CLOSE_WAIT_S)  # a failure before the session starts
        if audio.rate != SAMPLE_RATE:
            from ..live.rates import RateAdapter

            adapter = RateAdapter(audio.rate)
            out.info(f"the audio devices run at {audio.rate} Hz: resampling both ways")
    files = _Files(stack, plan)
    if plan.input_file is not None:
        from ..audio.frames import InputFrames
        from ..audio.io import open_audio

        frames = InputFrames(stack.enter_context(open_audio(plan.input_file)))
        # With a speaker, the sound card's clock paces the recording (no drift between
        # the two sides); without any device, the system clock does.
        source = RecordingCaller(frames, DeviceClock(stream) if stream else PacedClock())
    else:
        source = DeviceMic(stream, adapter, audio.canceller)
    sink = files.output if files.output is not None else Speaker(stream, adapter)
    record = files.record.write_stereo if files.record is not None else None
    engine = Engine(conversation, source, sink, record=record, stream=stream)
    monologue = _Monologue(files.transcript, whole_lines=out.interactive and sys.stdout.isatty())
    return _Session(engine, stream, files, monologue, title)


def _run(out: Output, plan: _Plan, audio: _Audio | None, conversation, device_name: str,
         voice: str, buffer_ms: float, duration: float | None) -> None:
    from ..live.errors import AudioDeviceError
    from .errors import Interrupted, exit_status

    title = _title(plan, audio, voice, device_name)
    error: BaseException | None = None
    ended = "error"
    with contextlib.ExitStack() as stack:
        session = _open_session(stack, out, plan, audio, conversation, title, buffer_ms)
        if plan.mic_and_speaker:
            out.note("echo cancellation is on, so laptop speakers work (--no-echo-cancel with "
                     "headphones)" if audio.canceller is not None else
                     "echo cancellation is off: use headphones, or the model hears itself")
        try:
            session.engine.start()
            if session.stream is not None:
                session.stream.start()
            ended = _converse(out, session, duration)
        except BaseException as caught:  # noqa: BLE001 - Ctrl-C, SIGTERM: shut down, then decide
            error = caught
        finally:
            released = _shut_down(session)
            ended = _ending(error, session) or ended
            final = session.engine.snapshot(window_s=1.0)
            session.files.write_stats({**final.as_json(), "ended": ended})
            session.files.close()
    error = error or session.engine.error or session.monologue.stdout_error
    _summary(out, final, plan, ended)
    if not released:  # PortAudio's own exit handler would hang as well: leave without it
        if not isinstance(error, AudioDeviceError):
            error = AudioDeviceError("the sound server does not let go of the audio device "
                                     "(it hangs)")
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(exit_status(error))
    if error is not None and not isinstance(error, Interrupted):
        raise error  # the error table reports it
    _leave(128 + error.signum if isinstance(error, Interrupted) else 0)


def _shut_down(session: _Session) -> bool:
    """Engine stopped (no write after this), stream closed, the last pieces out. False
    when the sound server did not let go of the device."""
    session.engine.stop()
    released = session.stream.close(CLOSE_WAIT_S) if session.stream is not None else True
    session.engine.join(STOP_WAIT_S)  # a step in progress may finish; it writes nothing
    session.monologue.drain(session.engine.pieces)
    session.monologue.close()
    return released


def _ending(error: BaseException | None, session: _Session) -> str | None:
    from .errors import Interrupted

    if isinstance(error, Interrupted):
        return "Ctrl-C" if error.signum == signal.SIGINT else "SIGTERM"
    if error is not None or session.engine.error is not None:
        return "error"
    return None


def _title(plan: _Plan, audio: _Audio | None, voice: str, device_name: str) -> str:
    caller = plan.input_file or "microphone"
    answer = plan.output_file or "speaker"
    parts = [f"voice {voice or 'none'}", device_name, f"{caller} → {answer}"]
    if audio is not None:
        parts.append(f"{audio.rate} Hz")
        if plan.mic_and_speaker:
            parts.append("echo cancellation " + ("on" if audio.canceller else "off"))
    return " · ".join(parts)


def _converse(out: Output, session: _Session, duration: float | None) -> str:
    """The main thread's part, until the session ends: returns why it ended."""
    engine, monologue = session.engine, session.monologue
    live = contextlib.nullcontext()
    if out.interactive:
        from rich.live import Live

        live = Live(get_renderable=lambda: render_view(engine.snapshot(), monologue,
                                                       session.title, console.width),
                    console=console, refresh_per_second=VIEW_HZ, transient=True,
                    redirect_stdout=monologue.whole_lines, redirect_stderr=False)
    began = time.monotonic()
    next_stats = 1.0
    with live:
        while True:
            finished = engine.wait(POLL_S)
            monologue.drain(engine.pieces)
            if monologue.stdout_error is not None:
                return "error"
            elapsed = time.monotonic() - began
            if elapsed >= next_stats:
                session.files.write_stats(engine.snapshot(window_s=1.0).as_json())
                next_stats += 1.0
            if finished:
                if engine.error is not None:
                    return "error"
                _let_the_speaker_finish(session)
                return "end of input"
            if duration is not None and elapsed >= duration:
                return "duration"


def _let_the_speaker_finish(session: _Session, limit_s: float = 2.0) -> None:
    """At the end of --input, play what is still queued for the speaker (the stream is
    stopped at once otherwise) and let the device's own latency pass."""
    stream = session.stream
    if stream is None or session.files.output is not None:  # no speaker
        return
    deadline = time.monotonic() + limit_s
    while stream.output.depth > 0 and time.monotonic() < deadline:
        time.sleep(POLL_S)
    time.sleep(min(0.5, stream.latency[1]))


def _summary(out: Output, s, plan: _Plan, ended: str) -> None:
    if out.quiet:
        return
    p50, p99 = s.session_compute_p50_ms, s.session_compute_p99_ms
    lines = [(f"session: {s.elapsed_s:.1f} s, ended by {ended}; {s.frames} frames heard "
              f"({s.frames * FRAME_MS / 1000:.1f} s), {s.dropped} dropped")]
    if p50 is not None:
        lines.append(f"compute: {p50:.0f} ms p50, {p99:.0f} ms p99 per 80 ms frame "
                     f"(real-time factor {p50 / FRAME_MS:.2f})")
    if s.callbacks is not None:
        lines.append(f"audio: {s.underruns} underruns, {s.overruns} overruns, "
                     f"{s.callbacks} callbacks of {s.expected_callbacks} expected "
                     f"(longest gap {s.max_callback_interval_ms:.0f} ms)")
    if s.session_echo_reduction_db is not None:
        lines.append(f"echo reduction: {s.session_echo_reduction_db:.0f} dB (median over the "
                     "seconds the assistant spoke; less while both speak)")
    elif s.echo_delay_ms is not None:
        lines.append("echo reduction: - (the assistant never spoke)")
    for what, path in (("recording", plan.record), ("output", plan.output_file),
                       ("transcript", plan.transcript), ("stats", plan.stats)):
        if path:
            lines.append(f"{what}: {path}")
    for line in lines:
        console.print(line, markup=False, highlight=False)


def _leave(status: int) -> None:
    """End the process now: everything the session opened is closed and flushed, and the
    interpreter's teardown with torch loaded (garbage-collecting its objects) takes
    0.4-0.8 s on a 2-core machine, which would break Ctrl-C's 200 ms. Only when this
    process is the CLI (its signal handler is in place); called in-process, it returns
    through Typer as usual."""
    from . import errors

    if signal.getsignal(signal.SIGINT) is not errors._on_signal:
        raise typer.Exit(status)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
