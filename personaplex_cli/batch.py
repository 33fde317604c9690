"""Answering many recordings: jobs, their checks before the model loads, and the run.

A `Job` is one recording to answer and where its reply, text and codes go, with its own
persona and seed. `reply IN... OUT` makes jobs from its arguments, `reply --manifest` from a
manifest's rows (manifest.py); both are checked whole before the model loads (`check`), so a
bad input fails in seconds, not after an hour of replies, and then `run` answers them with
continuous batching: a row whose reply is done takes the next job at once. Each job's
outputs are written atomically as its reply ends, so a killed run leaves only whole files,
and `--skip-existing` finishes the rest.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .outputs import (STDIO, check_input, check_output, is_url, open_output,
                      output_exists, reads, with_suffix)
from .codes import CODE_FORMATS, code_suffix_problem
from .core.config import (CONVERSATION_WINDOW, FRAME_SECONDS, FRAME_SIZE, MIMI_NUM_CODEBOOKS,
                          SAMPLE_RATE)
from .errors import InputError, OutputError, PersonaplexError
from .manifest import ManifestError, ManifestRow
from .transcript import FORMATS as TEXT_FORMATS


@dataclass
class Job:
    """One recording to answer and where its reply goes."""

    index: int  # its place in the run: with --seed S it draws from seed S + index
    input: str
    audio: str
    text: str | None = None
    codes: str | None = None
    voice: str = ""  # a --voice value ('' for none)
    role: str = ""
    seed: int | None = None
    tail_silence: float = 0.0
    where: str = ""  # how messages name it: the input, or the manifest line
    replace: bool = False  # its existing outputs may be replaced

    @property
    def outputs(self) -> list[str]:
        return [path for path in (self.audio, self.text, self.codes) if path]

    def complete(self) -> bool:
        """Every output is there (each is renamed into place only once whole)."""
        return all(output_exists(path) for path in self.outputs)


@dataclass
class Failure:
    job: Job
    error: PersonaplexError

    def __str__(self) -> str:
        message = self.error.message
        return message if self.job.where in message else f"{self.job.where}: {message}"


def side_output(value: str | None, formats: tuple[str, ...], audio: str,
                folder: Path | None = None) -> tuple[str | None, bool]:
    """--text-out/--codes-out -> (the file, whether it came from a format name): a format
    name (`srt`, `.srt`) puts the file beside the reply; anything else is the file (relative
    to `folder`, for a manifest). ValueError when there is nothing to put it beside, or
    when a code file's name has a suffix of another kind (`x.wav`)."""
    if value is None:
        return None, False
    bare = value.lstrip(".").lower()
    if bare in formats and os.sep not in value:
        if audio == STDIO:
            raise ValueError(f"the reply goes to stdout, so there is no file to put the "
                             f"{bare} beside: name one")
        return with_suffix(audio, "." + bare), True
    if formats == CODE_FORMATS and code_suffix_problem(value):
        raise ValueError(code_suffix_problem(value))
    if folder is not None and not _absolute(value):
        value = str(folder / value)
    return value, False


def jobs_from_manifest(rows: Sequence[ManifestRow], folder: Path, *, voice: str, role: str,
                       seed: int | None, tail_silence: float, text_out: str | None,
                       codes_out: str | None, failures: list[Failure] | None = None
                       ) -> list[Job]:
    """The manifest's rows as jobs: a field a row leaves out takes the option's value. A
    row that cannot be a job goes to `failures` when given (its line named), else raises.
    Row k is job k whatever the rows before it are, so it draws from seed S + k."""
    jobs, bad = [], []
    reads_stdin = None
    for index, row in enumerate(rows):
        values = row.values
        where = f"{row.source}:{row.line}"

        def path(name: str) -> str:
            value = values.get(name, "")  # none in a row that could not be read
            return value if not value or _absolute(value) else str(folder / value)

        audio = path("output")
        job = Job(index, path("input"), audio, where=where)
        try:
            if row.problem is not None:
                raise row.problem
            try:
                job.text, _ = side_output(values.get("text_out", text_out), TEXT_FORMATS,
                                          audio, folder)
                job.codes, _ = side_output(values.get("codes_out", codes_out), CODE_FORMATS,
                                           audio, folder)
            except ValueError as error:
                raise ManifestError(f"{where}: {error}") from None
            if job.input == STDIO:
                if reads_stdin is not None:
                    raise ManifestError(f"{where}: stdin (-) is already the input of "
                                        f"{reads_stdin}; it can be the input of one row only")
                reads_stdin = where
        except ManifestError as error:
            bad.append(Failure(job, error))
            continue
        row_seed = values.get("seed")
        job.voice = _manifest_voice(values.get("voice", voice), folder)
        job.role = values.get("prompt", role)
        job.seed = row_seed if row_seed is not None else (None if seed is None
                                                          else seed + index)
        job.tail_silence = values.get("tail_silence", tail_silence)
        jobs.append(job)
    if bad and failures is None:
        raise bad[0].error
    if failures is not None:
        failures.extend(bad)
    return jobs


def _absolute(path: str) -> bool:
    """Stdin/stdout, an absolute path or a URL: not relative to the manifest's folder."""
    return path == STDIO or os.path.isabs(path) or is_url(path)


def _manifest_voice(value: str, folder: Path) -> str:
    """A voice name stays a name; a relative voice file is the manifest folder's."""
    if value.lower().endswith((".pt", ".wav")) or os.sep in value:
        return str(folder / Path(value).expanduser())
    return value


def _output_key(path: str) -> str:
    return path if path == STDIO or is_url(path) else os.path.abspath(path)


def check_distinct_outputs(jobs: Sequence[Job]) -> None:
    """`reply IN... OUT`: no two outputs share a name (raises)."""
    outputs = [path for job in jobs for path in job.outputs]
    if outputs.count(STDIO) > 1:
        raise OutputError("only one output can go to stdout")
    seen = set()
    for job in jobs:
        for path in job.outputs:
            if _output_key(path) in seen:
                hint = " (inputs with the same stem?)" if len(jobs) > 1 else ""
                raise OutputError(f"two outputs would have the same name, "
                                  f"{_output_key(path)}{hint}")
            seen.add(_output_key(path))


def clashing_outputs(jobs: Sequence[Job]) -> tuple[list[Job], list[Failure]]:
    """A manifest's rows: a row that writes where an earlier row (or itself) already
    writes fails, naming both lines -> (the other jobs, those failures)."""
    first: dict[str, Job] = {}
    kept, failures = [], []
    for job in jobs:
        clash = None
        mine: set[str] = set()
        for path in job.outputs:
            key = _output_key(path)
            if key in first or key in mine:
                owner = first.get(key, job)
                clash = (f"{job.where}: {'stdout' if key == STDIO else path} is also an "
                         f"output of {'this row' if owner is job else owner.where}")
                break
            mine.add(key)
        if clash:
            failures.append(Failure(job, OutputError(clash)))
            continue
        first.update(dict.fromkeys(mine, job))
        kept.append(job)
    return kept, failures


# -- checks before the model loads ---------------------------------------------------------

def scan_input(path: str) -> None:
    """Reads a recording through once: readable, whole, finite and not empty (raises).
    Standard input and FIFOs are read once only, as they are answered."""
    import stat

    from .audio.io import check_readable

    check_input(path)
    if path != STDIO and stat.S_ISREG(os.stat(path).st_mode):
        check_readable(path)


def check(jobs: Sequence[Job], personas, *, force: bool, skip_existing: bool
          ) -> tuple[list[Job], list[Job], list[Failure]]:
    """Every job's input, outputs and persona, before any model weight loads ->
    (jobs to run, jobs already complete, failures)."""
    for job in jobs:  # a row's output may not be what another row reads
        reads(job.input, job.voice)
        with contextlib.suppress(PersonaplexError):
            found = personas.find(job.voice)
            reads(found.path if found else None)
    ready, done, failures = [], [], []
    for job in jobs:
        if skip_existing and job.complete():
            done.append(job)
            continue
        try:
            scan_input(job.input)
            job.replace = force or (skip_existing and any(
                output_exists(path) for path in job.outputs))
            for path in job.outputs:
                check_output(path, force=job.replace, inputs=(job.input,),
                             binary=path != job.text)
            personas.prompt(job.voice, job.role)
        except PersonaplexError as error:
            failures.append(Failure(job, error))
            continue
        ready.append(job)
    return ready, done, failures


# -- the run ---------------------------------------------------------------------------------

class Writers:
    """The outputs of one job, opened atomically; `add(frame)` as the reply comes, then
    `close(samples)` puts them in place (or `abort()` leaves nothing)."""

    def __init__(self, job: Job, rate: int, sample_format: str, length: int | None,
                 claimed: int | None, mimi_sha256: str):
        from .audio.frames import OutputPcm
        from .audio.writers import format_of, open_writer
        from .codes import CodeHeader, CodeWriter
        from .transcript import TranscriptWriter, format_of as text_format

        self._stack = stack = contextlib.ExitStack()
        inputs = (job.input,)
        try:
            sink = stack.enter_context(open_output(job.audio, force=job.replace,
                                                   inputs=inputs))
            # The audio may declare the length the input claims (a WAV header on a pipe,
            # where sox writes an estimate): if less comes, the header is patched, or on a
            # pipe the stream padded with silence. The codes declare only an exact length.
            out_length = None if claimed is None else OutputPcm.length(claimed, rate)
            self.audio = stack.enter_context(open_writer(sink, format_of(job.audio) or "wav",
                                                         rate, 1, sample_format,
                                                         num_frames=out_length))
            self.pcm = OutputPcm(self.audio.write, rate)
            self.text = None
            if job.text:
                text_sink = stack.enter_context(open_output(job.text, force=job.replace,
                                                            inputs=inputs, binary=False))
                stream = io.TextIOWrapper(text_sink, encoding="utf-8", newline="\n",
                                          write_through=True)
                stack.callback(stream.detach)
                self.text = TranscriptWriter(stream, text_format(job.text))
            self.codes = self.npy = None
            if job.codes:
                codes_sink = stack.enter_context(open_output(job.codes, force=job.replace,
                                                             inputs=inputs))
                if job.codes.lower().endswith(".npy"):
                    self.npy, self._npy_sink = [], codes_sink
                else:
                    frames = None if length is None else -(-length // FRAME_SIZE)
                    # The window rule the conversation decoded them with: decode follows it.
                    header = CodeHeader(num_codebooks=MIMI_NUM_CODEBOOKS, num_samples=length,
                                        weights_sha256=mimi_sha256,
                                        window=CONVERSATION_WINDOW)
                    self.codes = CodeWriter(codes_sink, header, frames)
        except BaseException:
            self.abort()
            raise

    def add(self, frame) -> None:
        self.pcm.write(frame.pcm)
        if self.text:
            self.text.add(frame.index, frame.piece)
        if self.codes is not None:
            self.codes.write(frame.codes[:, None])
        if self.npy is not None:
            self.npy.append(frame.codes)

    def close(self, samples: int) -> None:
        try:
            self.pcm.close()
            if self.text:
                self.text.close()
            if self.codes is not None:
                self.codes.close(num_samples=samples)
            if self.npy is not None:
                import numpy as np

                from .codes import save_npy

                save_npy(self._npy_sink, np.stack(self.npy, axis=1) if self.npy
                         else np.zeros((MIMI_NUM_CODEBOOKS, 0), np.int64))
        except BaseException:
            self.abort()
            raise
        self._stack.close()

    def abort(self) -> None:
        """Removes what was written (the outputs' temporary files)."""
        self._stack.__exit__(InputError, InputError("aborted"), None)


@dataclass
class Done:
    job: Job
    frames: int
    seconds: float  # from its start to its end
    worker: str | None = None  # where it was answered, when not here (host:pid)


@dataclass
class _Open:
    job: Job
    writers: Writers
    frames: object  # InputFrames
    reader: object  # AudioReader
    tail: int
    started: float = field(default_factory=time.monotonic)
    count: int = 0

    def finish(self) -> Done:
        self.reader.close()
        self.writers.close(self.frames.samples + self.tail)
        return Done(self.job, self.count, time.monotonic() - self.started)

    def abort(self) -> None:
        self.reader.close()
        self.writers.abort()


def expected_frames(job: Job) -> int | None:
    """Frames the reply takes, when the input's header tells its length (None for stdin)."""
    if job.input == STDIO:
        return None
    from .audio.frames import InputFrames
    from .audio.io import open_audio

    with open_audio(job.input) as reader:
        samples = InputFrames(reader).expected_samples
    if samples is None:
        return None
    return -(-(samples + round(job.tail_silence * SAMPLE_RATE)) // FRAME_SIZE)


def _frames_or_none(job: Job) -> int | None:
    try:
        return expected_frames(job)
    except PersonaplexError:
        return None  # reported when the job's turn comes and its input is opened


def run(scheduler, jobs: Sequence[Job], personas, sampling, *,
        rate: int, sample_formats: dict[str, str], keep_going: bool,
        on_done: Callable[[Done], None], on_failed: Callable[[Failure], None],
        on_frames: Callable[[int], None] = lambda count: None,
        warn: Callable[[str], None] | None = None,
        expected: dict[int, int | None] | None = None, stats=None,
        max_prime_s: float = 0.0) -> None:
    """Answers `jobs` on `scheduler` (runtime.open's, FREE-paced) with continuous batching,
    each job's persona from `personas` (runtime.personas.Personas). A job that
    fails (its input, its outputs) is reported; with `keep_going` the others go on, else
    the run stops there (finished jobs keep their outputs, unfinished ones leave none).
    The longest inputs start first (see runtime.scheduler.longest_first), by `expected`
    (frames by job index, as `expected_frames` counts them) where the caller has it, else
    by their headers read here. `stats` (a runtime.stats.StepStats) receives the steps'
    figures as they are made, for the caller's progress. A job whose role prompt needs more
    than `max_prime_s` of priming (0: no limit) fails with the figure, before its priming."""
    from .audio.frames import InputFrames
    from .audio.io import open_audio
    from .runtime.rows import ReplyRequest, longest_first

    if stats is not None:
        scheduler.stats = stats
    scheduler.max_prime_s = max_prime_s
    model = scheduler.model
    active: dict[int, _Open] = {}
    allowed: set = set()  # personas' keys the limit let through

    def requests() -> Iterator[ReplyRequest]:
        length = _frames_or_none if expected is None else (lambda job: expected.get(job.index))
        for job in longest_first(jobs, length):
            try:
                prompt = personas.prompt(job.voice, job.role)
                if prompt.key not in allowed:
                    scheduler.check_priming(prompt)
                    allowed.add(prompt.key)
                reader = open_audio(job.input, warn=warn)
                try:
                    frames = InputFrames(reader)
                    tail = round(job.tail_silence * SAMPLE_RATE)
                    length, claimed = ((None if samples is None else samples + tail)
                                       for samples in (frames.expected_samples,
                                                       frames.declared_samples))
                    writers = Writers(job, rate, sample_formats[job.audio], length, claimed,
                                      model.mimi_sha256)
                except BaseException:
                    reader.close()
                    raise
            except PersonaplexError as error:
                if not keep_going:
                    raise
                on_failed(Failure(job, error))
                continue
            active[job.index] = _Open(job, writers, frames, reader, tail)
            yield ReplyRequest(job.index, frames, prompt, sampling, job.seed, tail)

    try:
        for made, finished, failed in scheduler.answer(requests()):
            for key, frame in made:
                active[key].writers.add(frame)
                active[key].count += 1
            on_frames(len(made))
            for key, error in failed:
                opened = active.pop(key)
                opened.abort()
                if not keep_going:
                    raise error
                on_failed(Failure(opened.job, error))
            for key in finished:
                opened = active.pop(key)
                if opened.frames.samples == 0:
                    opened.abort()
                    error = InputError(f"{opened.job.input} holds no audio samples")
                    if not keep_going:
                        raise error
                    on_failed(Failure(opened.job, error))
                    continue
                on_done(opened.finish())
    finally:
        for opened in active.values():
            opened.abort()


def realtime_factor(seconds: float, frames: int) -> float:
    return seconds / max(1, frames) / FRAME_SECONDS
