"""`personaplex doctor`: check this machine for what the other commands need."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from .options import (COMPILE_DEFAULT, DEFAULT_MODEL, CompileOpt, DeviceOpt, DtypeOpt, Graphs,
                      GraphsOpt, ModelOpt, Quantize, QuantizeOpt, QuietOpt, VerboseOpt,
                      graphs_choice)
from ..errors import EXIT_FAILURE
from .output import Output

BENCH_SIZES = ("tiny", "mid", "full")  # doctor/bench.py's SIZES, here without torch
BenchSize = Enum("BenchSize", {size: size for size in BENCH_SIZES}, type=str)


def doctor(
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = Quantize.none,
    compile_mode: CompileOpt = COMPILE_DEFAULT,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Read the downloaded model's files whole and check each against "
        "the sha256 the hub gave for it (reads all 17 GB of the model).")] = False,
    json_output: Annotated[bool, typer.Option(
        "--json", help="Print the checks as one line of JSON: a list of "
        "{name, status, detail, fix}.")] = False,
    bench: Annotated[bool, typer.Option(
        "--bench", help="Instead of the checks: build the model with random weights on "
        "--device at --dtype and --quantize (nothing downloaded), run priming and frames at "
        "batch 1 and at the batch its memory holds, and report frame times, callers in real "
        "time and peak memory against the count.")] = False,
    size: Annotated[BenchSize, typer.Option(
        "--size", help="The model --bench builds: full (the 7B's dimensions), mid (about "
        "1.7B) or tiny (the test checkpoints').")] = BenchSize.full,
    frames: Annotated[int | None, typer.Option(
        "--frames", min=2, help="Frames --bench times at each batch (default: 50 tiny, 20 mid, "
        "6 full).")] = None,
    graphs: GraphsOpt = Graphs.auto,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Check Python, torch and the GPUs, the model's files, the token, the disk, audio and serve.

    Each check prints one line (ok, warn or fail) with what it found;
    a warning or a failure adds a fix on the line below. Nothing is
    downloaded or loaded: the model's files are only looked at on disk.
    The memory the model needs at --dtype (default: what reply takes on
    each device) and --quantize is counted from its architecture, as reply
    and talk count it before they load; its CUDA margin is an estimate,
    not measured.

    Exit status: 0 when nothing a command needs is missing (warnings
    allowed), else the code of the first failing check, in the order
    printed: 1 Python too old; 5 torch missing, or a GPU it has no kernels
    for, that is too small, or without fp8 for --quantize fp8; 3 the model
    or one of its files missing;
    6 a model file truncated, not safetensors or (with --verify) not
    what the hub gave; 8 too little disk for
    the download; 4 PortAudio missing. No GPU, no audio device, no echo
    canceller, no token (while the model is not here) and what serve lacks
    (its web packages, its default port free) are warnings.

    With --bench: random weights at --size's dimensions are loaded as
    reply loads a checkpoint, on --device at --dtype (default: reply's)
    and --quantize, the LM's step compiled as --compile says; the report
    names the kernel the linears ran. Exit 5 before anything is allocated
    when the device lacks the memory for one stream.
    """
    out = Output(quiet, verbose)
    if graphs != Graphs.auto and not bench:
        raise typer.BadParameter("--graphs says how --bench steps its batches: give --bench "
                                 "too", param_hint="'--graphs'")
    if bench:
        from ..doctor.agree import check
        from ..doctor.bench import report_lines, run_bench
        from ..model.device import resolve_device

        report = run_bench(size.value, device, dtype.value if dtype is not None else None,
                           quantize.value, frames, progress=out.info,
                           graphs=graphs_choice(graphs), warn=out.warn,
                           compile_mode=compile_mode.value, announce=out.note)
        out.info("agreement: a seeded tiny model on the CPU, eager and with graphs")
        verdicts = check(resolve_device(device), graphs_choice(graphs))
        if json_output:
            out.result_json({**report.as_json(),
                             "agreement": [verdict.as_json() for verdict in verdicts]})
        else:
            for line in report_lines(report) + [f"agree    {v.line()}" for v in verdicts]:
                out.result(line)
        if any(verdict.agree is False for verdict in verdicts):
            out.error("this device's tokens are not the CPU's: please report it, with "
                      "this output")
            raise typer.Exit(EXIT_FAILURE)
        return

    from ..doctor.check import exit_status
    from ..doctor.run import run_checks

    def timer(name: str, seconds: float, trace: str | None) -> None:
        out.info(f"doctor: {name} checked in {seconds:.2f} s")
        if trace:
            out.debug(trace.rstrip())

    checks = run_checks(model, dtype.value if dtype is not None else None, timer=timer,
                        quantize=quantize.value, verify=verify)
    if json_output:
        out.result_json([check.as_json() for check in checks])
    else:
        width = max(len(check.name) for check in checks)
        for check in checks:
            if quiet and check.status != "fail":
                continue
            out.result(f"{check.status:<5}{check.name:<{width + 2}}{check.detail}")
            if check.fix and check.status != "ok":
                out.result(f"{'':<{width + 7}}fix: {check.fix}")
    failed = sum(check.status == "fail" for check in checks)
    warned = sum(check.status == "warn" for check in checks)
    out.note(f"personaplex doctor: {failed} failed, {warned} warning"
             f"{'' if warned == 1 else 's'}, {len(checks) - failed - warned} ok")
    code = exit_status(checks)
    if code:
        raise typer.Exit(code)
