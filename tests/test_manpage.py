"""man/personaplex.1 is hand-written; these tests keep it in step with the CLI.

They walk the Typer command tree, so a new command, option, choice, environment
variable or exit status fails here until the man page documents it. In roff a
literal minus is `\\-`, so options are looked for in that escaped form.
"""

from __future__ import annotations

import enum
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import typer

from personaplex_cli import __version__, errors
from personaplex_cli.cli.app import app

MAN_PAGE = Path(__file__).resolve().parents[1] / "man" / "personaplex.1"


@pytest.fixture(scope="module")
def page() -> str:
    return MAN_PAGE.read_text(encoding="utf-8")


def roff(option: str) -> str:
    return option.replace("-", "\\-")


def section(page: str, title: str) -> str:
    """The roff source of one .SH section (up to the next .SH)."""
    match = re.search(rf'^\.SH "?{re.escape(title)}"?\s*$(.*?)(?=^\.SH |\Z)', page, re.M | re.S)
    assert match, f"no .SH {title} section"
    return match.group(1)


def _commands():
    group = typer.main.get_command(app)
    ctx = group.make_context("personaplex", [], resilient_parsing=True)
    yield "personaplex", group, ctx
    for name, command in group.commands.items():
        yield name, command, command.make_context(name, [], parent=ctx, resilient_parsing=True)


def _options():
    """(command name, option string, param) for every option, help included."""
    for name, command, ctx in _commands():
        for param in command.get_params(ctx):
            if param.param_type_name != "option":
                continue
            for opt in [*param.opts, *param.secondary_opts]:
                yield name, opt, param


def test_the_walk_finds_the_commands_and_options():
    names = [name for name, _, _ in _commands()]
    assert names[0] == "personaplex" and {"encode", "decode"} <= set(names)
    assert ("encode", "--codebooks") in {(c, o) for c, o, _ in _options()}


def test_every_command_has_a_subsection(page):
    headings = [line for line in page.splitlines() if line.startswith(".SS")]
    for name, _, _ in list(_commands())[1:]:
        assert any(re.search(rf"\b{name}\b", h) for h in headings), f"no .SS for {name}"
        assert f".B personaplex {name}\n" in section(page, "SYNOPSIS"), f"{name} not in SYNOPSIS"


def test_every_option_is_documented(page):
    missing = sorted({f"{cmd} {opt}" for cmd, opt, _ in _options() if roff(opt) not in page})
    assert not missing, f"options missing from {MAN_PAGE.name}: {missing}"


def test_every_command_option_is_in_the_synopsis(page):
    synopsis = section(page, "SYNOPSIS")
    missing = sorted({f"{cmd} {opt}" for cmd, opt, param in _options()
                      if cmd != "personaplex" and opt.startswith("--") and opt != "--help"
                      and roff(opt) not in synopsis
                      and not any(roff(o) in synopsis for o in param.opts)})
    assert not missing, f"not in the SYNOPSIS: {missing}"


def test_every_choice_is_documented(page):
    # Choices come from Enum-typed options; the default is one of the members (this avoids
    # Typer's parameter-type internals, which change between minor versions).
    checked = 0
    for cmd, opt, param in _options():
        if not isinstance(param.default, enum.Enum):
            continue
        for member in type(param.default):
            checked += 1
            assert rf"\fB{member.value}\fR" in page or f".B {member.value}" in page, (
                f"{cmd} {opt}: choice {member.value!r} not in the man page")
    assert checked >= 5  # --format auto|mimi|npy, --sample-format s16|f32


def test_every_environment_variable_is_documented(page):
    environment = section(page, "ENVIRONMENT")
    envvars = {param.envvar for _, _, param in _options() if param.envvar}
    assert envvars >= {"PERSONAPLEX_MODEL", "PERSONAPLEX_DEVICE"}
    for name in sorted(envvars) + ["HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN",
                                   "NO_COLOR", "XDG_CACHE_HOME"]:
        assert f".B {name}\n" in environment, f"{name} not under ENVIRONMENT"


def test_every_exit_status_is_documented(page):
    exit_status = section(page, "EXIT STATUS")
    codes = {value for key, value in vars(errors).items() if key.startswith("EXIT_")}
    assert {0, 1, 2, 3, 4, 5, 6, 7, 8, 130, 141} <= codes
    documented = {int(n) for n in re.findall(r"^\.TP\n\.B (\d+)$", exit_status, re.M)}
    assert codes <= documented, f"undocumented exit statuses: {sorted(codes - documented)}"
    assert documented <= codes, f"documented but not defined: {sorted(documented - codes)}"


def test_sections_and_version(page):
    titles = re.findall(r'^\.SH "?([^"\n]+?)"?$', page, re.M)
    for title in ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "COMMON OPTIONS",
                  "THE .MIMI FORMAT", "ENVIRONMENT", "FILES", "EXIT STATUS", "EXAMPLES",
                  "SEE ALSO"):
        assert title in titles, f"no {title} section"
    th = re.search(r"^\.TH (.*)$", page, re.M).group(1)
    assert f'"personaplex {__version__}"' in th
    see_also = section(page, "SEE ALSO")
    for ref in ("sox", "ffmpeg", "hf"):
        assert f".BR {ref} (1)" in see_also


def _linter() -> list[str] | None:
    if shutil.which("groff"):
        return ["groff", "-man", "-ww", "-z", str(MAN_PAGE)]
    if shutil.which("mandoc"):
        return ["mandoc", "-Tlint", "-W", "warning", str(MAN_PAGE)]
    return None


@pytest.mark.skipif(_linter() is None, reason="neither groff nor mandoc is installed")
def test_roff_has_no_warnings():
    proc = subprocess.run(_linter(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == proc.stderr == "", proc.stdout + proc.stderr
