"""`personaplex talk`: a live conversation, microphone to speaker, with a live view.

parse -> open (the recording checked, the devices in use found, the persona prepared, the
runtime opened: its memory check, the model loaded, the persona primed, the warm-up) -> run
(one audio stream, the engine thread of live/loop.py running talk's row on the runtime's
scheduler, this thread drawing and watching) -> report (a summary; the exit status).

Threads: PortAudio's callback only copies audio into and out of two bounded rings; the
engine thread reads a caller frame, cancels the echo, steps the model and queues the answer;
live/view.py's Terminal thread alone writes to the terminal (the monologue on stdout, the
view), so a terminal that takes no output stalls nothing else; this (main) thread hands it
the monologue, writes the stats each second, watches the engine (a model step that does
not return, callbacks that stop) and ends the session on Ctrl-C, at --duration, at the end
of --input, or when the engine fails (its exception is re-raised here, so the one error
table reports it).
The warm-up is the runtime's (runtime.open), the monologue's lines transcript.Lines'.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from ..core.config import FRAME_MS, SAMPLE_RATE, Sampling
from ..errors import OutputError
from ..outputs import check_input, check_output, reads, reads_model
from ..prompts.voices import DEFAULT_VOICE
from ..transcript import Lines
from .options import (COMPILE_DEFAULT, DEFAULT_MODEL, AudioTemperatureOpt, AudioTopKOpt, CompileOpt,
                      DeviceOpt, DtypeOpt, ForceOpt, Graphs, GraphsOpt, GreedyOpt, ModelOpt,
                      PromptFileOpt, PromptOpt, Quantize, QuantizeOpt, QuietOpt, SeedOpt,
                      TemperatureOpt, TopKOpt, VerboseOpt, VoiceOpt, audio_format, number_in,
                      role_text, sampling)
from .options import MAX_PRIME_S, MaxPrimeOpt
from .output import Output, console
from .persona import open_persona

STOP_WAIT_S = 0.15  # how long a stop waits for a step in progress (Ctrl-C: 200 ms in all)
CLOSE_WAIT_S = 1.0  # how long PortAudio may take to let go of the device
TERMINAL_WAIT_S = 1.0  # how long a terminal that takes no output (Ctrl-S) holds up the end
POLL_S = 0.05  # the main thread's heartbeat
LINE_CHARS = 80  # a monologue line on stdout ends before a word that would pass this
# A frame's work may take this many times the warm-up's p90, and at least STALL_MIN_S,
# before the session is called stalled (a busy machine slows a step down several-fold).
STALL_FACTOR = 20
STALL_MIN_S = 10.0


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
        "--buffer", metavar="MS", callback=number_in(0, 2000),
        help="Assistant audio (0 to 2000 ms) kept waiting for the speaker beyond the frame "
        "it plays: absorbs slow frames and late callbacks, adds as much latency.")] = 80.0,
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
        "--duration", metavar="SECONDS", callback=number_in(0.1),
        help="End the session after this long (0.1 s or more).")
    ] = None,
    temperature: TemperatureOpt = Sampling.temp_text,
    top_k: TopKOpt = Sampling.top_k_text,
    audio_temperature: AudioTemperatureOpt = Sampling.temp_audio,
    audio_top_k: AudioTopKOpt = Sampling.top_k_audio,
    greedy: GreedyOpt = False,
    seed: SeedOpt = None,
    max_prime_s: MaxPrimeOpt = MAX_PRIME_S,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = Quantize.none,
    graphs: GraphsOpt = Graphs.auto,
    compile_mode: CompileOpt = COMPILE_DEFAULT,
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
    reads(voice, prompt_file)
    reads_model(model)
    plan = _plan(record, transcript, stats, input_file, output_file, input_device,
                 output_device, force)
    role = role_text(prompt, prompt_file)
    if input_file is not None and os.path.isfile(input_file):
        from ..audio.io import check_readable

        # Read through before the model loads: a NaN a minute in, or a file without a
        # sample, fails now and not after the warm-up (a pipe is read once, in session).
        check_readable(input_file)
    audio = None
    if plan.uses_device:
        audio = _Audio.find(plan, input_device, output_device, echo=not no_echo_cancel)
    how = sampling(temperature, top_k, audio_temperature, audio_top_k, greedy)
    talking, device_name, stall_s = _prepare(out, model, device, dtype, quantize, voice, role,
                                             how, seed, max_prime_s, graphs, compile_mode)
    _run(out, plan, audio, talking, device_name, voice, buffer, duration, stall_s)


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

    @property
    def sides(self) -> str:
        """The audio device's sides in use (live.devices.SIDES), when `uses_device`."""
        if self.mic_and_speaker:
            return "duplex"
        return "output" if self.input_file is not None else "input"


def _plan(record, transcript, stats, input_file, output_file, input_device, output_device,
          force) -> _Plan:
    outputs = {"--record": record, "--transcript": transcript, "--stats": stats,
               "--output": output_file}
    for option, path in outputs.items():
        if path == "-":
            raise typer.BadParameter("stdout carries the inner monologue; name a file",
                                     param_hint=f"'{option}'")
    if output_file is not None:
        audio_format(output_file, "--output")  # a suffix we cannot write is refused
    if record is not None and audio_format(record, "--record") != "wav":
        raise typer.BadParameter(f"{record}: the recording is a stereo WAV; name it .wav",
                                 param_hint="'--record'")
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


# -- audio devices, checked before the model loads ---------------------------------------

@dataclass
class _Audio:
    sides: str  # live.devices.SIDES
    input: int | None  # None: not used (a recording replaces the microphone)
    output: int | None  # None: not used (a file replaces the speaker)
    rate: int
    canceller: Any  # live.echo.EchoCanceller, or None

    @classmethod
    def find(cls, plan: _Plan, input_device: str | None, output_device: str | None,
             echo: bool) -> _Audio:
        """Only the sides in use are looked up: `--input FILE` needs a speaker only,
        `--output FILE` a microphone only."""
        from ..live.devices import choose_samplerate, import_sounddevice, resolve_device

        sd = import_sounddevice()
        sides = plan.sides
        index_in = resolve_device(input_device, "input", sd) if sides != "output" else None
        index_out = resolve_device(output_device, "output", sd) if sides != "input" else None
        rate = choose_samplerate(index_in, index_out, sd=sd)
        canceller = None
        if echo and sides == "duplex":
            from ..live.echo import EchoCanceller

            canceller = EchoCanceller(rate)
        return cls(sides, index_in, index_out, rate, canceller)


# -- the model: load, persona, prime, warm up ----------------------------------------------

def _prepare(out: Output, model_spec: str, device: str, dtype, quantize, voice_spec: str,
             role: str, how, seed: int | None, max_prime_s: float, graphs=None,
             compile_mode=None):
    """-> ((the runtime's scheduler, talk's row on it), the device's name, how long a
    frame's work may take before the session is called stalled). A role prompt over
    --max-prime-s is refused before its priming."""
    from ..runtime import open as open_runtime
    from ..runtime.rows import SourceRow
    from ..runtime.scheduler import Pacing
    from ..runtime.warmup import verdict

    the_model, prompt = open_persona(out, model_spec, device, dtype, voice_spec, role,
                                     quantize=quantize, graphs=graphs,
                                     compile_mode=compile_mode)
    scheduler = open_runtime(the_model, prompt, 1, Pacing.SOURCE, sampling=how,
                             max_prime_s=max_prime_s, say=out.info, warn=out.warn,
                             note=out.note)
    warmup = scheduler.warmup
    times = warmup.times[1]
    parameters = sum(p.numel() for p in the_model.lm.parameters())
    out.note(verdict(times, the_model.device.type, parameters, warmup.threads))
    stall_s = max(STALL_MIN_S, STALL_FACTOR * times.p90_ms / 1000.0)
    return (scheduler, SourceRow(prompt, how, seed)), the_model.device.type, stall_s


# -- the inner monologue -------------------------------------------------------------------

class _Monologue:
    """The text pieces as they come: stdout (a piece at a time, or a line at a time under
    the live view, through `terminal`, a live.view.Terminal), the --transcript file, and
    the last lines for the view. A stdout that fails (a reader gone) shows in
    `stdout_error`, for the main loop to end the session with."""

    def __init__(self, transcript, whole_lines: bool, terminal):
        self.transcript = transcript
        self.whole_lines = whole_lines  # under the live view: only complete lines on stdout
        self.terminal = terminal
        self._lines = Lines(LINE_CHARS)
        self.lines: list[str] = []

    @property
    def stdout_error(self) -> OSError | None:
        return self.terminal.error

    def add(self, index: int, piece: str) -> None:
        if self.transcript is not None:
            self.transcript.add(index, piece)
        before = self._lines.text
        ended = self._lines.add(index, piece)
        if ended is not None:
            self._end_line(ended.text)
            before = ""
        if not self.whole_lines and len(self._lines.text) > len(before):
            self._stdout(self._lines.text[len(before):])

    def drain(self, pieces) -> None:
        """Takes every (frame index, piece) the engine has queued so far."""
        while pieces:
            self.add(*pieces.popleft())

    def _end_line(self, text: str) -> None:
        self._stdout((text if self.whole_lines else "") + "\n")
        self.lines = (self.lines + [text])[-20:]

    def _stdout(self, text: str) -> None:
        self.terminal.put(text)

    def tail(self, count: int) -> list[str]:
        """The last lines, the unfinished one included."""
        return (self.lines + ([self._lines.text] if self._lines.text else []))[-count:]

    def close(self) -> None:
        if self.transcript is not None:
            self.transcript.close()
        ended = self._lines.flush()
        if ended is not None:
            self._end_line(ended.text)


# -- the session ---------------------------------------------------------------------------

class _Files:
    """The session's outputs, opened in place right before it starts. `remove()` deletes
    the regular files among them (never a device or a FIFO)."""

    def __init__(self, stack: contextlib.ExitStack, plan: _Plan):
        from ..live.record import IncrementalWav

        self.record = self.output = self.transcript = self.stats = None
        self._regular: list[str] = []
        if plan.record:
            self.record = IncrementalWav(self._open(stack, plan.record, plan.force), 2)
        if plan.output_file:
            self.output = _open_writer(self._open(stack, plan.output_file, plan.force),
                                       plan.output_file)
        if plan.transcript:
            from ..transcript import TranscriptWriter, format_of

            self.transcript = TranscriptWriter(
                self._open(stack, plan.transcript, plan.force, binary=False),
                format_of(plan.transcript))
        if plan.stats:
            self.stats = self._open(stack, plan.stats, plan.force, binary=False)

    def _open(self, stack: contextlib.ExitStack, path: str, force: bool, binary: bool = True):
        """Opened for writing where it is (talk's files grow during the session: a reader
        can follow them, and a killed session leaves what was written), unlike the atomic
        outputs of the other commands. Devices and FIFOs work too."""
        check_output(path, force=force)  # again: it may have appeared while the model loaded
        regular = not os.path.exists(path) or os.path.isfile(path)
        try:  # entered into the caller's stack, which closes it
            handle = (open(path, "wb") if binary  # noqa: SIM115
                      else open(path, "w", encoding="utf-8", newline="\n"))  # noqa: SIM115
        except OSError as error:
            raise OutputError(f"cannot write {path}: {error.strerror or error}") from None
        if regular:
            self._regular.append(path)
        return stack.enter_context(handle)

    def write_stats(self, line: dict) -> None:
        if self.stats is not None:
            self.stats.write(json.dumps(line) + "\n")
            self.stats.flush()

    def close(self) -> None:
        for writer in (self.record, self.output):
            if writer is not None:
                writer.close()

    def remove(self) -> None:
        for path in self._regular:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _open_writer(handle, path: str):
    from ..audio.writers import format_of, open_writer
    from ..live.record import IncrementalWav

    fmt = format_of(path) or "wav"
    if fmt == "wav":  # header kept true every second, as --record's
        return IncrementalWav(handle, 1)
    return open_writer(handle, fmt, SAMPLE_RATE, 1, "f32" if fmt == "raw" else "s16")


@dataclass
class _Talk:
    """A talk session's parts, opened."""

    loop: Any  # live.loop.LiveLoop
    stream: Any  # live.devices.DuplexStream, or None
    files: _Files
    monologue: _Monologue
    title: str
    stall_s: float  # a frame's work longer than this ends the session


def _open_session(stack: contextlib.ExitStack, out: Output, plan: _Plan,
                  audio: _Audio | None, talking, title: str,
                  buffer_ms: float, stall_s: float) -> _Talk:
    from ..live.loop import (
        DeviceClock,
        DeviceMic,
        LiveLoop,
        PacedClock,
        RecordingCaller,
        Speaker,
    )

    stream = adapter = None
    if audio is not None:  # opened (not started) first: a device error leaves no files
        from ..live.devices import DuplexStream
        from ..live.jitter import ASSISTANT_QUEUE_MS

        # Playback starts once a frame more than --buffer waits: each callback takes a
        # frame, so only what waits beyond it cushions a slow step, or a late callback
        # followed by a catch-up one (a prefill of just --buffer would give no cushion).
        stream = DuplexStream(audio.input, audio.output, sides=audio.sides,
                              samplerate=audio.rate, prefill_ms=buffer_ms + FRAME_MS,
                              output_capacity_ms=buffer_ms + FRAME_MS + ASSISTANT_QUEUE_MS)
        stack.callback(stream.close, CLOSE_WAIT_S)  # a failure before the session starts
        if audio.rate != SAMPLE_RATE:
            from ..live.rates import RateAdapter

            adapter = RateAdapter(audio.rate)
            out.info(f"the audio device runs at {audio.rate} Hz: resampling")
    files = _Files(stack, plan)
    if plan.input_file is not None:
        from ..audio.frames import InputFrames
        from ..audio.io import open_audio

        frames = InputFrames(stack.enter_context(open_audio(plan.input_file, warn=out.warn)))
        # With a speaker, the sound card's clock paces the recording (no drift between
        # the two sides); without any device, the system clock does.
        source = RecordingCaller(frames, DeviceClock(stream) if stream else PacedClock())
    else:
        source = DeviceMic(stream, adapter, audio.canceller)
    sink = files.output if files.output is not None else Speaker(stream, adapter)
    record = files.record.write_stereo if files.record is not None else None
    loop = LiveLoop(*talking, source, sink, record=record, stream=stream)
    from ..live.view import LiveView, Terminal

    whole_lines = out.interactive and sys.stdout.isatty()
    view = None
    if out.interactive:
        view = LiveView(console, loop.snapshot, lambda: monologue.tail(3), title,
                        redirect_stdout=whole_lines)
    monologue = _Monologue(files.transcript, whole_lines, Terminal(_write_stdout, view))
    return _Talk(loop, stream, files, monologue, title, stall_s)


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _run(out: Output, plan: _Plan, audio: _Audio | None, talking, device_name: str,
         voice: str, buffer_ms: float, duration: float | None, stall_s: float) -> None:
    from ..errors import AudioDeviceError
    from .errors import Interrupted, exit_status

    title = _title(plan, audio, voice, device_name)
    error: BaseException | None = None
    ended = "error"
    removed = False
    with contextlib.ExitStack() as stack:
        session = _open_session(stack, out, plan, audio, talking, title, buffer_ms,
                                stall_s)
        if plan.mic_and_speaker:
            out.note("echo cancellation is on, so laptop speakers work (--no-echo-cancel with "
                     "headphones)" if audio.canceller is not None else
                     "echo cancellation is off: use headphones, or the model hears itself")
        try:
            session.monologue.terminal.start()
            session.loop.start()
            if session.stream is not None:
                session.stream.start()
            ended = _converse(session, duration)
        except BaseException as caught:  # noqa: BLE001 - Ctrl-C, SIGTERM: shut down, then decide
            error = caught
        finally:
            released = _shut_down(session)
            ended = _ending(error, session) or ended
            final = session.loop.snapshot(window_s=1.0)
            last = {**final.as_json(), "ended": ended}
            failure = error or session.loop.error
            if ended == "error" and isinstance(failure, Exception):
                last["error"] = str(failure)
            session.files.write_stats(last)
            session.files.close()
            if ended == "error" and (plan.input_file is not None or final.frames == 0):
                # Nothing worth keeping: a recording can be replayed, and a session that
                # heard nothing left only headers. A live conversation that failed midway
                # keeps what it recorded (it cannot be had again).
                session.files.remove()
                removed = True
    error = error or session.loop.error or session.monologue.stdout_error
    _summary(out, final, plan, ended, removed)
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


def _shut_down(session: _Talk) -> bool:
    """LiveLoop stopped (no write after this), stream closed, the last pieces out. False
    when the sound server did not let go of the device."""
    session.loop.stop(STOP_WAIT_S)
    released = session.stream.close(CLOSE_WAIT_S) if session.stream is not None else True
    session.loop.join(STOP_WAIT_S)  # a step in progress may finish; it writes nothing
    session.monologue.drain(session.loop.pieces)
    session.monologue.close()
    session.monologue.terminal.close(TERMINAL_WAIT_S)
    return released


def _ending(error: BaseException | None, session: _Talk) -> str | None:
    from .errors import Interrupted

    if isinstance(error, Interrupted):
        return "Ctrl-C" if error.signum == signal.SIGINT else "SIGTERM"
    if error is not None or session.loop.error is not None:
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


def _converse(session: _Talk, duration: float | None) -> str:
    """The main thread's part, until the session ends: returns why it ended, or raises
    what ended it (the engine's watchdog: a stalled step, audio callbacks that stopped).
    It never writes to the terminal (session.monologue.terminal's thread does)."""
    loop, monologue = session.loop, session.monologue
    began = time.monotonic()
    next_stats = 1.0
    while True:
        finished = loop.wait(POLL_S)
        monologue.drain(loop.pieces)
        if monologue.stdout_error is not None:
            return "error"
        elapsed = time.monotonic() - began
        if elapsed >= next_stats:
            session.files.write_stats(loop.snapshot(window_s=1.0).as_json())
            next_stats += 1.0
        if finished:
            if loop.error is not None:
                return "error"
            _let_the_speaker_finish(session)
            return "end of input"
        loop.check(session.stall_s)
        if duration is not None and elapsed >= duration:
            return "duration"


def _let_the_speaker_finish(session: _Talk, limit_s: float = 2.0) -> None:
    """At the end of --input, play what is still queued for the speaker (the stream is
    stopped at once otherwise) and let the device's own latency pass."""
    stream = session.stream
    if stream is None or session.files.output is not None:  # no speaker
        return
    deadline = time.monotonic() + limit_s
    while stream.output.depth > 0 and time.monotonic() < deadline:
        time.sleep(POLL_S)
    time.sleep(min(0.5, stream.latency[1]))


def _summary(out: Output, s, plan: _Plan, ended: str, removed: bool) -> None:
    if out.quiet:
        return
    from ..live.view import echo_text

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
    if s.echo_delay_ms is not None:
        lines.append(f"echo: {echo_text(s, session=True)}")
    for what, path in (("recording", plan.record), ("output", plan.output_file),
                       ("transcript", plan.transcript), ("stats", plan.stats)):
        if path:
            gone = removed and not os.path.exists(path)
            lines.append(f"{what}: {path}" + (" (removed: the session failed)" if gone else ""))
    # From a thread of its own, waited for a while only: a terminal that takes no output
    # must not keep the session from ending (the last --stats line says how it ended).
    def show() -> None:
        for line in lines:
            console.print(line, markup=False, highlight=False)

    printer = threading.Thread(target=show, daemon=True)
    printer.start()
    printer.join(TERMINAL_WAIT_S)


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
