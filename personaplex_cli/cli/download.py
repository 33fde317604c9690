"""`personaplex download`: fetch the model from the Hugging Face hub into its cache."""

from __future__ import annotations

from typing import Annotated

import typer

from .options import DEFAULT_MODEL, QuietOpt, VerboseOpt
from .output import Output


def download(
    model: Annotated[str, typer.Option(
        "--model", "-m", envvar="PERSONAPLEX_MODEL", metavar="REPO",
        help="The Hugging Face repo to fetch.")] = DEFAULT_MODEL,
    revision: Annotated[str | None, typer.Option(
        "--revision", metavar="REV", help="A branch, tag or commit (default: main).")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", metavar="TOKEN", show_default=False,
        help="A Hugging Face token (default: HF_TOKEN, else the `hf auth login` one).")] = None,
    json_output: Annotated[bool, typer.Option(
        "--json", help="Print the result as JSON: repo, revision, path and files.")] = False,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Also check the files already downloaded against the sha256 the "
        "hub gives (each fetched file always is), and fetch a damaged one again.")] = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Download the model (17.1 GB) into the Hugging Face cache; resumes and skips what is there.

    Fetches exactly what personaplex uses: the language model, Mimi, the text tokenizer and
    the voices. The model is gated: accept its licence on its hub page, then `hf auth login`
    or set HF_TOKEN. The last line printed is the model's local folder.
    """
    import os

    from ..model.download import download as fetch
    from ..model.files import repo_id_problem

    out = Output(quiet, verbose)
    if os.path.isdir(os.path.expanduser(model)):
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
