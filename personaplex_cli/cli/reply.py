"""`personaplex reply`: the model answers recordings, offline, one or many at once."""

from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from ..core.config import FRAME_SECONDS, FRAME_SIZE, MIMI_NUM_CODEBOOKS, SAMPLE_RATE
from ..errors import InputError, OutputError
from ..prompts.voices import DEFAULT_VOICE
from ..transcript import FORMATS as TEXT_FORMATS
from .files import STDIO, check_input, check_output, open_output
from .options import (DEFAULT_MODEL, AudioTemperatureOpt, AudioTopKOpt, DeviceOpt, DtypeOpt,
                      ForceOpt, GreedyOpt, ModelOpt, PromptFileOpt, PromptOpt, Quantize,
                      QuantizeOpt, QuietOpt, RateOpt, SampleFormatOpt, SeedOpt, TemperatureOpt,
                      TopKOpt, VerboseOpt, VoiceOpt, check_rate, role_text, sampling,
                      samples_as)
from .output import Output
from .persona import open_conversation

CODE_FORMATS = ("mimi", "npy")


@dataclass
class Job:
    """One input and where its reply, text and codes go."""

    input: str
    audio: str
    text: str | None
    codes: str | None


def _split_paths(paths: list[str], output: str | None) -> tuple[list[str], str]:
    if output is not None:
        return paths, output
    if len(paths) < 2:
        raise typer.BadParameter("name the output: personaplex reply IN OUT (or -o OUT)",
                                 param_hint="'IN... OUT'")
    return paths[:-1], paths[-1]


def _side_output(value: str | None, formats: tuple[str, ...], audio: str, several: bool,
                 option: str) -> str | None:
    """--text-out/--codes-out: a file for one input; a format name (`srt`, `.srt`) puts a
    file beside each reply instead."""
    if value is None:
        return None
    bare = value.lstrip(".").lower()
    if bare in formats and os.sep not in value:
        if audio == STDIO:
            raise typer.BadParameter(f"the reply goes to stdout, so there is no file to put "
                                     f"the {bare} beside: name one", param_hint=f"'{option}'")
        return str(Path(audio).with_suffix("." + bare))
    if several:
        raise typer.BadParameter(f"with several inputs, give a format ({', '.join(formats)}) "
                                 "and each input gets its own file beside its reply",
                                 param_hint=f"'{option}'")
    return value


def _plan(inputs: list[str], target: str, text_out: str | None, codes_out: str | None,
          force: bool) -> list[Job]:
    several = len(inputs) > 1
    if inputs.count(STDIO) > 1 or (several and STDIO in inputs):
        raise typer.BadParameter("stdin (-) can be the only input", param_hint="'IN...'")
    for path in inputs:
        check_input(path)
    into_dir = os.path.isdir(target)
    if several and not into_dir:
        raise OutputError(f"{target} is not a directory; with several inputs OUT must be "
                          "an existing directory")
    jobs = []
    for path in inputs:
        audio = target
        if into_dir:
            if path == STDIO:
                raise OutputError("a reply to stdin needs an output file name, not a directory")
            audio = str(Path(target) / (Path(path).stem + ".wav"))
        jobs.append(Job(path, audio, _side_output(text_out, TEXT_FORMATS, audio, several,
                                                  "--text-out"),
                        _side_output(codes_out, CODE_FORMATS, audio, several, "--codes-out")))
    outputs = [p for job in jobs for p in (job.audio, job.text, job.codes) if p]
    named = [p for p in outputs if p != STDIO]
    if len(set(map(os.path.abspath, named))) != len(named):
        raise OutputError("two outputs would have the same name (inputs with the same stem?)")
    if outputs.count(STDIO) > 1:
        raise OutputError("only one output can go to stdout")
    for job in jobs:  # refused before the model loads, not after minutes of work
        for path in (job.audio, job.text, job.codes):
            if path and path != STDIO:
                check_output(path, force=force, inputs=(job.input,))
    return jobs


class _Writers:
    """The outputs of one job, opened atomically; `add(frame)` as replies come."""

    def __init__(self, stack: contextlib.ExitStack, job: Job, force: bool, rate: int,
                 sample_format: str, length: int | None, mimi_sha256: str):
        from ..audio.frames import OutputPcm
        from ..audio.writers import format_of, open_writer
        from ..codes import CodeHeader, CodeWriter
        from ..transcript import TranscriptWriter, format_of as text_format

        inputs = (job.input,)
        sink = stack.enter_context(open_output(job.audio, force=force, inputs=inputs))
        fmt = format_of(job.audio) or "wav"
        out_length = None if length is None else OutputPcm.length(length, rate)
        self.audio = stack.enter_context(open_writer(sink, fmt, rate, 1, sample_format,
                                                     num_frames=out_length))
        self.pcm = OutputPcm(self.audio.write, rate)
        self.text = None
        if job.text:
            text_sink = stack.enter_context(open_output(job.text, force=force, inputs=inputs,
                                                        binary=False))
            stream = io.TextIOWrapper(text_sink, encoding="utf-8", newline="\n",
                                      write_through=True)
            stack.callback(stream.detach)
            self.text = TranscriptWriter(stream, text_format(job.text))
        self.codes = self.npy = None
        if job.codes:
            codes_sink = stack.enter_context(open_output(job.codes, force=force, inputs=inputs))
            if job.codes.lower().endswith(".npy"):
                self.npy, self._npy_sink = [], codes_sink
            else:
                frames = None if length is None else -(-length // FRAME_SIZE)
                self.codes = CodeWriter(codes_sink, CodeHeader(
                    num_codebooks=MIMI_NUM_CODEBOOKS, num_samples=length, weights_sha256=mimi_sha256), frames)

    def add(self, frame) -> None:
        self.pcm.write(frame.pcm)
        if self.text:
            self.text.add(frame.index, frame.piece)
        if self.codes is not None:
            self.codes.write(frame.codes[:, None])
        if self.npy is not None:
            self.npy.append(frame.codes)

    def close(self, samples: int) -> None:
        self.pcm.close()
        if self.text:
            self.text.close()
        if self.codes is not None:
            self.codes.close(num_samples=samples)
        if self.npy is not None:
            import numpy as np

            from ..codes import save_npy

            save_npy(self._npy_sink, np.stack(self.npy, axis=1) if self.npy
                     else np.zeros((MIMI_NUM_CODEBOOKS, 0), np.int64))


def reply(
    paths: Annotated[list[str], typer.Argument(
        metavar="IN... OUT", help="Recordings to answer (- for stdin), then the output: a "
        "file (- for stdout) or, for several inputs, a directory.")],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", metavar="OUT",
        help="The output (then every argument is an input).")] = None,
    voice: VoiceOpt = DEFAULT_VOICE,
    prompt: PromptOpt = None,
    prompt_file: PromptFileOpt = None,
    temperature: TemperatureOpt = 0.7,
    top_k: TopKOpt = 25,
    audio_temperature: AudioTemperatureOpt = 0.8,
    audio_top_k: AudioTopKOpt = 250,
    greedy: GreedyOpt = False,
    seed: SeedOpt = None,
    tail_silence: Annotated[float, typer.Option(
        "--tail-silence", min=0.0, max=600.0, metavar="SECONDS",
        help="Listen this much silence after the input, so the answer can finish.")] = 0.0,
    text_out: Annotated[str | None, typer.Option(
        "--text-out", metavar="FILE|FORMAT",
        help="The inner monologue: .json per frame (NVIDIA's format), .srt/.vtt subtitles, "
        "else plain text.")] = None,
    codes_out: Annotated[str | None, typer.Option(
        "--codes-out", metavar="FILE|FORMAT",
        help="The assistant's Mimi codes: .mimi or .npy.")] = None,
    rate: RateOpt = SAMPLE_RATE,
    sample_format: SampleFormatOpt = None,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", "-b", min=1, max=256,
        help="How many inputs run at once, in lockstep (bounds memory).")] = 8,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = Quantize.none,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Answer recordings: the model listens to IN and speaks its reply into OUT.

    The reply is as long as the input, since the model answers while it listens (add
    --tail-silence to let it finish). Several inputs (`reply a.wav b.wav -o DIR/`) run as
    one batch with the same persona; each reply is trimmed to its own input.
    """
    out = Output(quiet, verbose)
    inputs, target = _split_paths(paths, output)
    jobs = _plan(inputs, target, text_out, codes_out, force)
    from ..audio.writers import format_of

    sample_as = {job.audio: samples_as(format_of(job.audio) or "wav", sample_format)
                 for job in jobs}
    for job in jobs:
        check_rate(format_of(job.audio) or "wav", rate)
    if prompt_file == STDIO and STDIO in inputs:  # refused before stdin is read
        raise typer.BadParameter("stdin cannot be both the input and the prompt file",
                                 param_hint="'--prompt-file'")
    role = role_text(prompt, prompt_file)

    from ..audio.io import open_audio

    for job in jobs:  # a bad input fails before the model loads
        if job.input != STDIO:
            open_audio(job.input).close()
    started = time.monotonic()
    how = sampling(temperature, top_k, audio_temperature, audio_top_k, greedy)
    conversation = open_conversation(out, model, device, dtype, voice, role, how,
                                     batch=min(batch_size, len(jobs)), quantize=quantize)
    out.debug(f"loaded in {time.monotonic() - started:.1f} s")
    _run(out, conversation, jobs, seed, tail_silence, rate, sample_as, force)


def _run(out: Output, conversation, jobs: list[Job], seed, tail_silence: float, rate: int,
         sample_as: dict[str, str], force: bool) -> None:
    from ..audio.frames import InputFrames
    from ..audio.io import open_audio
    from ..conversation import reply_stream

    batch = conversation.batch
    mimi_sha256 = conversation.model.mimi_sha256
    tail = round(tail_silence * SAMPLE_RATE)

    for first in range(0, len(jobs), batch):
        group = jobs[first:first + batch]
        seeds = [None if seed is None else seed + first + b for b in range(batch)]
        with contextlib.ExitStack() as stack:
            frames = []
            for job in group:
                reader = stack.enter_context(open_audio(job.input))
                frames.append(InputFrames(reader))
            writers = [_Writers(stack, job, force, rate, sample_as[job.audio],
                                None if f.expected_samples is None
                                else f.expected_samples + tail, mimi_sha256)
                       for job, f in zip(group, frames)]
            primed = time.monotonic()
            conversation.start(seeds)
            out.debug(f"primed {batch} stream(s) in {time.monotonic() - primed:.2f} s")
            total = max((f.expected_samples or 0) + tail for f in frames) / SAMPLE_RATE
            names = ", ".join(job.input for job in group)
            with out.progress(f"replying to {names}", total or None) as advance:
                begun = time.monotonic()
                steps = 0
                for step in reply_stream(conversation, frames, tail_samples=tail):
                    for writer, frame in zip(writers, step):
                        if frame is not None:
                            writer.add(frame)
                    steps += 1
                    elapsed = time.monotonic() - begun
                    advance(FRAME_SECONDS, f"RTF {elapsed / (steps * FRAME_SECONDS):.2f}")
            for job, f in zip(group, frames):
                if f.samples == 0:  # raised inside: the outputs are not kept
                    raise InputError(f"{job.input} holds no audio samples")
            for writer, f in zip(writers, frames):
                writer.close(f.samples + tail)
            if steps:
                out.info(f"{', '.join(job.audio for job in group)}: {steps} frames in "
                         f"{elapsed:.1f} s (real-time factor "
                         f"{elapsed / (steps * FRAME_SECONDS):.2f})")
