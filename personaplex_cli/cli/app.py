"""The `personaplex` command: assembles the subcommands. Imports typer and stdlib only."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import __version__
from .decode import decode
from .encode import encode

app = typer.Typer(
    name="personaplex",
    help="Run NVIDIA PersonaPlex, a full-duplex speech-to-speech model, and its Mimi codec.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=True,
)


def _version(value: bool) -> None:
    if value:
        print(f"personaplex {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run NVIDIA PersonaPlex, a full-duplex speech-to-speech model, and its Mimi codec.

    Every file argument takes - for stdin/stdout, so the commands work in pipelines:
    personaplex encode in.wav -o - | personaplex decode - -o out.wav
    """


app.command(no_args_is_help=True)(encode)
app.command(no_args_is_help=True)(decode)


def main() -> None:
    app()
