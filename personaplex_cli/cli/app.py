"""The `personaplex` command: assembles the subcommands and runs them under the one error
table (cli/errors.py). Imports typer, rich and the standard library only."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .. import __version__, outputs
from . import errors, helptext, manual
from .decode import decode
from .doctor import doctor
from .download import download
from .encode import encode
from .reply import reply
from .serve import serve
from .talk import talk
from .voices import app as voices_app

app = typer.Typer(
    name="personaplex",
    help="Run NVIDIA PersonaPlex, a full-duplex speech-to-speech model, and its Mimi codec.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=True,
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"personaplex {__version__}\n")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run NVIDIA PersonaPlex, a full-duplex speech-to-speech model, and its Mimi codec.

    Every file argument takes - for stdin/stdout, so the commands work in pipelines:
    personaplex encode in.wav -o - | personaplex decode - -o out.wav
    """
    outputs.forget_reads()
    errors.COMMAND = ctx.invoked_subcommand  # its error lines name its own options


app.command()(download)
app.command(no_args_is_help=True)(encode)
app.command(no_args_is_help=True)(decode)
app.command(no_args_is_help=True)(reply)
app.command()(talk)
app.command()(serve)
app.add_typer(voices_app, name="voices")
app.command()(doctor)
app.command("help")(manual.help)
helptext.install(app)


def main() -> None:
    errors.install_signal_handlers()
    command = typer.main.get_command(app)
    sys.exit(errors.run(lambda: command.main(prog_name="personaplex", standalone_mode=False)))
