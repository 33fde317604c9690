"""How help and usage read: where Typer 0.29's presentation is adjusted, all in one place.

- Arguments are named in capitals, as a command line shows them (`IN... OUT`, `NAME`,
  `RECORDING NAME`), never as Typer 0.27+ prints them (`{IN... OUT}...`, `{name}`).
- A flag or a counter shows no value type (`--force <bool>` reads as if it took a value).
- A description is prose: the line breaks of a docstring are not kept (rich markup mode
  keeps them, which breaks lines mid-sentence at 80 columns); a paragraph that starts with
  `\b` (Click's marker) is kept as written.
- A command named without any argument answers with its usage line and the hint
  (`NoArguments`, reported by cli/errors.py), not with its whole help.

Imports typer and the standard library only (the help and every TAB pass through here).
"""

from __future__ import annotations

import inspect

import typer
from typer import _click
from typer.core import TyperArgument, TyperCommand, TyperOption


class NoArguments(_click.exceptions.UsageError):
    """A command that needs arguments was given none: cli/errors.py prints its usage line."""

    def __init__(self, ctx: _click.Context):
        super().__init__("", ctx)


def prose(text: str | None) -> str | None:
    """A docstring's paragraphs, each on one line (those starting with \\b as written)."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split()) for p in paragraphs)


def _argument_name(self: TyperArgument) -> str:
    return self.metavar if self.metavar is not None else self.name.upper()


def _usage_name(self: TyperArgument) -> str:
    name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
    # A metavar says how many itself (`IN... OUT`); a plain name repeats with "...".
    return name + "..." if self.nargs != 1 and self.metavar is None else name


_display_type_rich = TyperOption.display_type_rich


def _flag_type(self: TyperOption, ctx) -> str | None:
    if self.is_flag or self.count:
        return None
    return _display_type_rich(self, ctx)


_parse_args = TyperCommand.parse_args


def _parse_args_or_usage(self: TyperCommand, ctx: _click.Context, args: list[str]):
    if not args and self.no_args_is_help and not ctx.resilient_parsing:
        raise NoArguments(ctx)
    return _parse_args(self, ctx, args)


def install(app: typer.Typer) -> None:
    """Applies the above to Typer's classes and to every command registered under `app`."""
    TyperArgument.display_name_raw = property(_argument_name)  # type: ignore[assignment]
    TyperArgument._usage_display_name = _usage_name  # type: ignore[method-assign]
    TyperOption.display_type_rich = _flag_type  # type: ignore[method-assign]
    TyperCommand.parse_args = _parse_args_or_usage  # type: ignore[method-assign]
    _unwrap_help(app)


def _unwrap_help(app: typer.Typer) -> None:
    for info in app.registered_commands:
        info.help = prose(info.help if info.help is not None else inspect.getdoc(info.callback))
    for group in app.registered_groups:
        if group.typer_instance is not None:
            _unwrap_help(group.typer_instance)
