"""`personaplex download`: fetch the model from the Hugging Face hub into its cache."""

from __future__ import annotations

from typing import Annotated

import typer
from typer._click.core import ParameterSource

from .options import DEFAULT_MODEL, QuietOpt, VerboseOpt
from .output import Output


def download(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(
        "--model", "-m", envvar="PERSONAPLEX_MODEL", metavar="REPO",
        help="The Hugging Face repo to fetch.")] = DEFAULT_MODEL,
    revision: Annotated[str | None, typer.Option(
        "--revision", metavar="REV", help="A branch, tag or commit (default: main).")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", metavar="TOKEN", show_default=False,
        help="A Hugging Face token (default: HF_TOKEN, else the `hf auth login` one).")] = None,
    json_output: Annotated[bool, typer.Option(
        "--json", help="Print the result as JSON: repo, revision, path and files "
        "(with --tiny, repo and revision are null).")] = False,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Also check the files already downloaded against the sha256 the "
        "hub gives (each fetched file always is), and fetch a damaged one again.")] = False,
    tiny: Annotated[bool, typer.Option(
        "--tiny", help="Instead, write a tiny model with random weights in the real layout "
        "(15 MB, seconds, no network): every command runs on it, but it speaks noise.")] = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Download the model (17.1 GB) into the Hugging Face cache; resumes and skips what is there.

    Fetches exactly what personaplex uses: the language model, Mimi, the text tokenizer and
    the voices. The model is gated: accept its licence on its hub page, then `hf auth login`
    or set HF_TOKEN. The last line printed is the model's local folder.

    With --tiny, nothing is downloaded: a tiny random-weight model is written into
    personaplex's cache, to try every command and to test what you build on them.
    """
    import os

    out = Output(quiet, verbose)
    if tiny:
        given = [name for name, value in (("--revision", revision), ("--token", token))
                 if value is not None]
        given += ["--verify"] if verify else []
        if ctx.get_parameter_source("model") == ParameterSource.COMMANDLINE:
            given.append("--model")
        if given:
            raise typer.BadParameter(f"--tiny writes its model here, from nothing: "
                                     f"{', '.join(given)} is for the hub",
                                     param_hint="'--tiny'")
        write_tiny(out, json_output)
        return

    from ..model.download import download as fetch
    from ..model.files import repo_id_problem

    if os.path.isdir(os.path.expanduser(model)):
        if ctx.get_parameter_source("model") == ParameterSource.ENVIRONMENT:
            # As after `export PERSONAPLEX_MODEL=$(personaplex download --tiny)`.
            raise typer.BadParameter(
                f"{model} is a local folder; download takes a Hugging Face repo id: give "
                f"--model {DEFAULT_MODEL}, or unset PERSONAPLEX_MODEL",
                param_hint="'--model' (from PERSONAPLEX_MODEL)")
        raise typer.BadParameter(f"{model} is a local folder; download takes a Hugging Face "
                                 f"repo id (default {DEFAULT_MODEL})", param_hint="'--model'")
    problem = repo_id_problem(model)
    if problem:
        raise typer.BadParameter(f"{problem}, such as {DEFAULT_MODEL}", param_hint="'--model'")
    result = fetch(model, revision=revision, token=token, progress=not quiet,
                   report=out.note, verify=verify)
    for entry in result.files:
        out.info(f"{entry.name}: {entry.size} bytes{' (fetched)' if entry.fetched else ''}")
    if json_output:
        out.result_json(result.as_json())
    else:
        out.result(str(result.path))


def write_tiny(out: Output, json_output: bool) -> None:
    from ..model.random_model import write_tiny_model
    from ..model.voices_archive import format_size

    model = write_tiny_model()
    out.note(f"wrote a tiny model with random weights ({format_size(model.size)}, "
             f"{model.seconds:.1f} s): every command runs on it, but what it says is noise, "
             f"not speech. Use it with --model {model.path} or PERSONAPLEX_MODEL; "
             f"for the real model, run `personaplex download`.")
    if json_output:
        out.result_json(model.as_json())
    else:
        out.result(str(model.path))
