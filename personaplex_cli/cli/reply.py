"""`personaplex reply`: the model answers recordings, offline, one or many at once.

parse -> plan (jobs from the arguments or a manifest) -> check every job before the model
loads -> run them with continuous batching (personaplex_cli.batch) -> report.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ..core.config import FRAME_SECONDS, SAMPLE_RATE, Sampling
from ..errors import InputError, OutputError, PersonaplexError
from ..outputs import STDIO, check_input, reads, reads_model
from ..prompts.voices import DEFAULT_VOICE
from .options import (DEFAULT_MODEL, AudioTemperatureOpt, AudioTopKOpt, DeviceOpt, DtypeOpt,
                      COMPILE_DEFAULT, CompileOpt, ForceOpt, Graphs, GraphsOpt, GreedyOpt, ModelOpt,
                      PromptFileOpt, PromptOpt, Quantize, QuantizeOpt, QuietOpt, RateOpt, RayOpt,
                      SampleFormatOpt, SeedOpt, TemperatureOpt, TopKOpt, VerboseOpt, VoiceOpt,
                      audio_format, check_rate, graphs_choice, number_in, role_text, sampling,
                      samples_as)
from .options import OFFLINE_MAX_PRIME_S, MaxPrimeOpt
from .output import Output


class RunFailed(InputError):
    """Some jobs could not be answered (exit 7, or the first failure's status)."""


def _split_paths(paths: list[str], output: str | None) -> tuple[list[str], str]:
    if output is not None:
        return paths, output
    if len(paths) < 2:
        raise typer.BadParameter("name the output: personaplex reply IN OUT (or -o OUT)",
                                 param_hint="'IN... OUT'")
    return paths[:-1], paths[-1]


def _plan(inputs: list[str], target: str, *, voice: str, role: str, seed: int | None,
          tail_silence: float, text_out: str | None, codes_out: str | None):
    """The jobs of `reply IN... OUT`: OUT is the reply's file, or for several inputs the
    directory their replies go into."""
    from ..batch import TEXT_FORMATS, Job, side_output
    from ..codes import CODE_FORMATS

    several = len(inputs) > 1
    if inputs.count(STDIO) > 1 or (several and STDIO in inputs):
        raise typer.BadParameter("stdin (-) can be the only input", param_hint="'IN...'")
    for path in inputs:
        check_input(path)
    into_dir = os.path.isdir(target)
    if several and not into_dir:
        problem = "is not a directory" if os.path.exists(target) else "does not exist"
        raise OutputError(f"{target} {problem}; with several inputs OUT must be an existing "
                          "directory")
    jobs = []
    for index, path in enumerate(inputs):
        audio = target
        if into_dir:
            if path == STDIO:
                raise OutputError("a reply to stdin needs an output file name, not a directory")
            audio = str(Path(target) / (Path(path).stem + ".wav"))
        sides = []
        for value, formats, option in ((text_out, TEXT_FORMATS, "--text-out"),
                                       (codes_out, CODE_FORMATS, "--codes-out")):
            try:
                side, from_format = side_output(value, formats, audio)
            except ValueError as error:
                raise typer.BadParameter(str(error), param_hint=f"'{option}'") from None
            if several and side is not None and not from_format:
                raise typer.BadParameter(f"with several inputs, give a format "
                                         f"({', '.join(formats)}) and each input gets its own "
                                         "file beside its reply", param_hint=f"'{option}'")
            sides.append(side)
        jobs.append(Job(index, path, audio, *sides, voice=voice, role=role,
                        seed=None if seed is None else seed + index,
                        tail_silence=tail_silence, where=path))
    return jobs


def reply(
    paths: Annotated[list[str] | None, typer.Argument(
        metavar="IN... OUT", show_default=False,
        help="Recordings to answer (- for stdin), then the output: a file (- for stdout) "
        "or, for several inputs, a directory.")] = None,
    output: Annotated[str | None, typer.Option(
        "--output", "-o", metavar="OUT",
        help="The output (then every argument is an input).")] = None,
    voice: VoiceOpt = DEFAULT_VOICE,
    prompt: PromptOpt = None,
    prompt_file: PromptFileOpt = None,
    temperature: TemperatureOpt = Sampling.temp_text,
    top_k: TopKOpt = Sampling.top_k_text,
    audio_temperature: AudioTemperatureOpt = Sampling.temp_audio,
    audio_top_k: AudioTopKOpt = Sampling.top_k_audio,
    greedy: GreedyOpt = False,
    seed: SeedOpt = None,
    max_prime_s: MaxPrimeOpt = OFFLINE_MAX_PRIME_S,
    tail_silence: Annotated[float, typer.Option(
        "--tail-silence", callback=number_in(0, 600), metavar="SECONDS",
        help="Listen this much silence (0 to 600 s) after the input, so the answer can "
        "finish.")] = 0.0,
    text_out: Annotated[str | None, typer.Option(
        "--text-out", metavar="FILE|FORMAT",
        help="The inner monologue: .json per frame (NVIDIA's format), .srt/.vtt subtitles, "
        "else plain text.")] = None,
    codes_out: Annotated[str | None, typer.Option(
        "--codes-out", metavar="FILE|FORMAT",
        help="The assistant's Mimi codes: .mimi or .npy.")] = None,
    rate: RateOpt = SAMPLE_RATE,
    sample_format: SampleFormatOpt = None,
    manifest: Annotated[str | None, typer.Option(
        "--manifest", metavar="FILE",
        help="Answer the rows of a JSON-lines or CSV file (input, output; optional voice, "
        "prompt, seed, text_out, codes_out, tail_silence), each with its own persona; - "
        "for stdin.")] = None,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", "-b", min=1, max=256, metavar="N",
        help="How many recordings are answered at once; one that ends makes room for the "
        "next at once (bounds memory).")] = 8,
    keep_going: Annotated[bool, typer.Option(
        "--keep-going",
        help="Answer the good inputs when some are bad, and exit 7 at the end with the "
        "list of those that failed.")] = False,
    skip_existing: Annotated[bool, typer.Option(
        "--skip-existing",
        help="Leave alone the inputs whose outputs are all there (a rerun after an "
        "interruption finishes the rest).")] = False,
    json_lines: Annotated[bool, typer.Option(
        "--json", help="Print one JSON line per input on stdout as it is done.")] = False,
    ray_address: RayOpt = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, max=4096, metavar="N",
        help="With --ray: at most N workers, each holding the model (default: one per GPU "
        "of the cluster, or one on CPUs).")] = None,
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
    """Answer recordings: the model listens to IN and speaks its reply into OUT.

    The reply is as long as the input, since the model answers while it listens (add
    --tail-silence to let it finish). Several inputs (`reply a.wav b.wav -o DIR/`, or a
    --manifest) are answered --batch-size at a time; each reply's codes and text equal the
    same input answered alone (its audio within the last bit). Every input is checked before the model loads. A --manifest runs on a
    Ray cluster with --ray (the same bytes as here).
    """
    out = Output(quiet, verbose)
    from .. import batch

    if ray_address is None and workers is not None:
        raise typer.BadParameter("--workers sizes the pool of a --ray run: give --ray too",
                                 param_hint="'--workers'")
    if manifest is None and ray_address is not None:
        raise typer.BadParameter("--ray answers the rows of a --manifest: give one",
                                 param_hint="'--ray'")
    if manifest is not None:
        if paths or output is not None:
            raise typer.BadParameter("with --manifest, the inputs and outputs are its rows: "
                                     "give no IN, OUT or -o", param_hint="'--manifest'")
        if prompt_file == STDIO and manifest == STDIO:
            raise typer.BadParameter("stdin cannot be both the manifest and the prompt file",
                                     param_hint="'--prompt-file'")
        if ray_address is not None:
            from ..cluster.ray_cluster import import_ray

            import_ray(ray_address)  # without the extra, stop before anything is read
    elif not paths:
        from typer._click.exceptions import UsageError
        from typer._click.globals import get_current_context

        raise UsageError("Missing argument 'IN... OUT' (or --manifest FILE).",
                         ctx=get_current_context(silent=True))
    reads(voice, prompt_file, manifest)
    reads_model(model)
    bad_rows: list = []  # a manifest's rows that cannot be jobs, reported with the others
    if manifest is not None:
        from ..manifest import read_manifest

        role = role_text(prompt, prompt_file)
        rows, folder = read_manifest(manifest, sys.stdin, bad_rows=True)
        jobs = batch.jobs_from_manifest(rows, folder, voice=voice, role=role, seed=seed,
                                        tail_silence=tail_silence, text_out=text_out,
                                        codes_out=codes_out, failures=bad_rows)
        jobs, clashes = batch.clashing_outputs(jobs)
        bad_rows += clashes
    else:
        inputs, target = _split_paths(paths, output)
        if prompt_file == STDIO and STDIO in inputs:  # refused before stdin is read
            raise typer.BadParameter("stdin cannot be both the input and the prompt file",
                                     param_hint="'--prompt-file'")
        role = role_text(prompt, prompt_file)
        jobs = _plan(inputs, target, voice=voice, role=role, seed=seed,
                     tail_silence=tail_silence, text_out=text_out, codes_out=codes_out)
        batch.check_distinct_outputs(jobs)
    if ray_address is not None and any(STDIO in (job.input, *job.outputs) for job in jobs):
        raise typer.BadParameter("the rows of a --ray run are answered on other processes: "
                                 "none can read stdin or write stdout", param_hint="'--ray'")
    if json_lines and any(STDIO in job.outputs for job in jobs):
        raise typer.BadParameter("--json prints on stdout, so no output can go there",
                                 param_hint="'--json'")
    sample_formats = _audio_formats(jobs, rate, sample_format,
                                    None if manifest is None else bad_rows)
    jobs = [job for job in jobs if job.audio in sample_formats]
    how = sampling(temperature, top_k, audio_temperature, audio_top_k, greedy)

    from .persona import open_model

    started = time.monotonic()
    if ray_address is None:
        the_model = open_model(out, model, device, dtype, quantize, graphs, compile_mode)
    else:  # the workers load it where they run; here its files only check the rows
        from ..model.model import Model

        the_model = Model.open(model, "cpu")
    from ..runtime.personas import Personas

    personas = Personas(the_model)
    ready, done, failures = batch.check(jobs, personas, force=force,
                                        skip_existing=skip_existing)
    failures = sorted(bad_rows + failures, key=lambda failure: failure.job.index)
    total = len(jobs) + len(bad_rows)
    for job in done:
        _report(out, json_lines, job, "skipped")
    if done:
        out.note(f"{len(done)} of {total} already answered, left alone")
    if failures and not keep_going:
        _refuse(out, failures, total, named=manifest is not None)
    for failure in failures:
        out.warn(f"{failure}: skipped")
        _report(out, json_lines, failure.job, "failed", error=failure.error.message)
    if ready and ray_address is not None:
        failures += _run_on_ray(out, ray_address, workers, ready, personas, how, batch_size,
                                rate, sample_formats, keep_going, json_lines, started,
                                model=model, device=device, dtype=dtype, quantize=quantize,
                                max_prime_s=max_prime_s, graphs=graphs_choice(graphs))
    elif ready:
        from ..runtime import open as open_runtime
        from ..runtime.scheduler import Pacing

        # Opened once the inputs are known good: the memory check reads the checkpoint's
        # header, and the model loads.
        scheduler = open_runtime(the_model, None, min(batch_size, len(ready)), Pacing.FREE,
                                 option="--batch-size", say=out.info, warn=out.warn,
                                 note=out.note)
        out.info(f"{len(ready)} to answer with {len(personas)} persona(s), "
                 f"{scheduler.capacity} at a time")

        def answer(expected, stats, capacity, **report) -> None:
            batch.run(scheduler, ready, personas, how, rate=rate,
                      sample_formats=sample_formats, keep_going=keep_going, warn=out.warn,
                      expected=expected, stats=stats, max_prime_s=max_prime_s, **report)

        failures += _run(out, ready, batch_size, json_lines, started, answer)
    if failures:
        # Each failure had its own line as it happened: the last one names them only.
        raise RunFailed(f"{len(failures)} of {total} input(s) failed: "
                        + ", ".join(failure.job.where for failure in failures[:5])
                        + (", ..." if len(failures) > 5 else "") + " (said above)")


def _audio_formats(jobs, rate: int, sample_format, bad_rows: list | None) -> dict[str, str]:
    """Each reply's sample format, from its suffix; what it cannot store is refused (for
    a manifest, its row goes to `bad_rows`, its line named)."""
    from ..batch import Failure
    from ..manifest import ManifestError

    formats = {}
    for job in jobs:
        try:
            fmt = audio_format(job.audio, "OUT")
        except typer.BadParameter as error:
            if bad_rows is None:
                raise
            bad_rows.append(Failure(job, ManifestError(f"{job.where}: "
                                                       f"{error.format_message()}")))
            continue
        check_rate(fmt, rate)
        formats[job.audio] = samples_as(fmt, sample_format)
    return formats


def _refuse(out: Output, failures, total: int, named: bool) -> None:
    """Stops before any work: one line per bad job, the last one's error raised (each
    naming its manifest line, when `named`)."""
    if total == 1 and not named:
        raise failures[0].error
    if total == 1:
        raise type(failures[0].error)(str(failures[0]))
    for failure in failures[:-1]:
        out.error(str(failure))
    last = failures[-1]
    raise type(last.error)(f"{last}; {len(failures)} of {total} inputs cannot be answered, "
                           "so none was (--keep-going answers the others)")


def _report(out: Output, json_lines: bool, job, status: str, **fields) -> None:
    if json_lines:
        out.result_json({"status": status, "where": job.where, "input": job.input or None,
                         "output": job.audio or None, "text_out": job.text, "codes_out": job.codes,
                         **fields})


def _run_on_ray(out: Output, address: str, workers: int | None, jobs, personas, how,
                batch_size: int, rate: int, sample_formats: dict[str, str], keep_going: bool,
                json_lines: bool, started: float, *, model: str, device: str, dtype,
                quantize, max_prime_s: float, graphs: bool | None = None) -> list:
    from ..cluster.replies import answer_on_ray
    from ..cluster.ray_cluster import connect, plan_pool

    for job in jobs:  # each worker finds the same files, wherever it runs
        job.voice = personas.voice_file(job.voice)
    ray = connect(address, verbose=out.verbose)
    try:
        pool = plan_pool(ray, device, workers, len(jobs))
        capacity = min(batch_size, len(jobs))
        out.info(f"{len(jobs)} to answer on Ray with {len(personas)} persona(s): "
                 f"{pool.workers} worker(s) on {'GPUs' if pool.gpus else 'CPUs'}, "
                 f"{capacity} at a time each")

        def answer(expected, stats, **report) -> None:  # the workers' steps stay theirs
            answer_on_ray(ray, pool, jobs, model=model, device=device,
                          dtype=dtype.value if dtype else None,
                          quantize=quantize.value if quantize else "none", sampling=how,
                          rate=rate, sample_formats=sample_formats, keep_going=keep_going,
                          expected=expected, max_prime_s=max_prime_s, graphs=graphs,
                          **report)

        return _run(out, jobs, batch_size, json_lines, started, answer)
    finally:
        ray.shutdown()


def _run(out: Output, jobs, batch_size: int, json_lines: bool, started: float,
         answer) -> list:
    """Answers `jobs` through `answer(expected, stats, capacity=, on_done=, on_failed=,
    on_frames=)`, reporting each as it ends, and the progress -> the failures. The progress
    and the last line read the runtime's StepStats (the measure serve's /metrics and talk's
    live line read), where the steps run here."""
    from .. import batch
    from ..runtime.stats import StepStats

    expected = {job.index: batch.expected_frames(job) for job in jobs}
    total_frames = None if None in expected.values() else sum(expected.values())
    failures = []
    answered = 0
    begun = None
    frames_done = 0
    steps = StepStats()

    def on_done(done: batch.Done) -> None:
        nonlocal answered
        answered += 1
        rtf = batch.realtime_factor(done.seconds, done.frames)
        out.info(f"{done.job.where} -> {done.job.audio}: {done.frames} frames in "
                 f"{done.seconds:.1f} s (real-time factor {rtf:.2f})")
        where = {} if done.worker is None else {"worker": done.worker}
        _report(out, json_lines, done.job, "done", frames=done.frames,
                seconds=round(done.seconds, 3), **where)

    def on_failed(failure: batch.Failure) -> None:
        out.warn(f"{failure}: skipped")
        _report(out, json_lines, failure.job, "failed", error=failure.error.message)
        failures.append(failure)

    with out.progress(f"answering {len(jobs)}", total_frames, unit="frames") as advance:
        def status() -> str:
            if begun is None:
                return f"{answered}/{len(jobs)} done"
            per_second = frames_done / max(1e-9, time.monotonic() - begun)
            line = f"{answered}/{len(jobs)} done, {per_second:.1f} frames/s"
            p50 = steps.step_ms(0.5)
            return line if p50 is None else f"{line}, step p50 {p50:.0f} ms"

        def on_done_shown(done: batch.Done) -> None:
            on_done(done)
            advance(0, status())

        def on_frames(count: int) -> None:
            nonlocal begun, frames_done
            if begun is None:
                begun = time.monotonic()
                out.debug(f"loaded and primed in {begun - started:.1f} s")
            frames_done += count
            advance(count, status())

        answer(expected, steps, capacity=min(batch_size, len(jobs)), on_done=on_done_shown,
               on_failed=on_failed, on_frames=on_frames)
    if begun is not None and frames_done:
        elapsed = time.monotonic() - begun
        out.info(f"{answered} of {len(jobs)} answered: {frames_done} frames in "
                 f"{elapsed:.1f} s ({frames_done / elapsed:.1f} frames/s, real-time factor "
                 f"{elapsed / (frames_done * FRAME_SECONDS):.2f} per stream)")
    if steps.steps:
        out.info(f"{steps.steps} steps of {steps.frames} row-frames: step p50 "
                 f"{steps.step_ms(0.5):.1f} ms, p99 {steps.step_ms(0.99):.1f} ms, real-time "
                 f"factor {steps.real_time_factor():.2f} per step")
    return failures
