"""man/personaplex.1 is hand-written; these tests keep it in step with the CLI.

They walk the Typer command tree, groups included (`voices create` is a command of its
own here), so a new command, option, choice, default, environment variable or exit
status fails here until the man page documents it. In roff a literal minus is `\\-`,
so options are looked for in that escaped form, as whole options (`--input` is not
found inside `--input-device`, nor `-o` inside `--output`).
"""

from __future__ import annotations

import enum
import inspect
import re
import shutil
import subprocess
import types
import typing
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


def _is_group(command) -> bool:
    return isinstance(getattr(command, "commands", None), dict)


def _commands():
    """(name, command, context) for the app and every command below it, depth first: a
    group's subcommands are named after it ("voices create")."""
    group = typer.main.get_command(app)
    ctx = group.make_context("personaplex", [], resilient_parsing=True)
    yield "personaplex", group, ctx
    yield from _below(group, ctx, "")


def _below(group, ctx, prefix: str):
    for name, command in group.commands.items():
        full = f"{prefix}{name}"
        sub = command.make_context(name, [], parent=ctx, resilient_parsing=True)
        yield full, command, sub
        if _is_group(command):
            yield from _below(command, sub, f"{full} ")


def _options():
    """(command name, option string, param) for every option, help included."""
    for name, command, ctx in _commands():
        for param in command.get_params(ctx):
            if param.param_type_name != "option":
                continue
            for opt in [*param.opts, *param.secondary_opts]:
                yield name, opt, param


def _mentions(text: str, option: str) -> bool:
    """Whether `option` occurs in roff `text` as a whole option: not as the tail of a
    longer one (`\\-o` in `\\-\\-output`) nor as the head (`\\-\\-input` in
    `\\-\\-input\\-device`)."""
    return re.search(rf"(?<!-){re.escape(roff(option))}(?![\w]|\\-)", text) is not None


def _headings(page: str) -> list[str]:
    return [line for line in page.splitlines() if line.startswith(".SS")]


def _names_heading(heading: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", heading) is not None


def _subsections(page: str, name: str) -> str:
    """The roff source of every .SS whose heading names command `name`."""
    parts = re.findall(r"^(\.SS .*?)(?=^\.SS |^\.SH |\Z)", page, re.M | re.S)
    return "".join(part for part in parts if _names_heading(part.splitlines()[0], name))


def _synopsis_of(page: str, name: str) -> str:
    """The SYNOPSIS lines of command `name`: from `.B personaplex NAME` to the next
    command's line."""
    blocks = re.split(r"^(?=\.B personaplex(?: .*)?$)", section(page, "SYNOPSIS"), flags=re.M)
    head = ".B personaplex" + ("" if name == "personaplex" else f" {name}")
    return "".join(block for block in blocks if block.split("\n", 1)[0] == head)


def _where_documented(page: str, name: str) -> str:
    """Where the options of `name` may be described: its own subsection(s), or COMMON
    OPTIONS (with its own subsections: the persona options, those of personaplex). Every
    heading names personaplex, so its own options count in COMMON OPTIONS only."""
    own = "" if name == "personaplex" else _subsections(page, name)
    return own + section(page, "COMMON OPTIONS")


_PARAGRAPH_END = re.compile(r"^\.(TP|PP|P|LP|IP|RS|SS|SH)\b")


def _tagged_paragraphs(text: str, option: str) -> list[str]:
    """The .TP items of roff `text` whose tag (the line after .TP or .TQ) names `option`,
    each up to the next paragraph macro."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if i and re.match(r"^\.(TP|TQ)\b", lines[i - 1]) and _mentions(line, option):
            body = [line]
            for following in lines[i + 1:]:
                if _PARAGRAPH_END.match(following):
                    break
                body.append(following)
            found.append("\n".join(body))
    return found


def test_the_walk_finds_the_commands_and_options():
    names = [name for name, _, _ in _commands()]
    assert names[0] == "personaplex" and {"encode", "decode"} <= set(names)
    assert {"download", "reply", "talk", "doctor", "help", "voices", "voices list",
            "voices show", "voices create"} <= set(names)
    options = {(c, o) for c, o, _ in _options()}
    assert ("encode", "--codebooks") in options
    assert {("voices create", "--dtype"), ("voices list", "--json"),
            ("voices show", "--model"), ("talk", "--no-echo-cancel")} <= options


def test_every_command_has_a_subsection(page):
    headings = _headings(page)
    synopsis = section(page, "SYNOPSIS")
    for name, command, _ in list(_commands())[1:]:
        assert any(_names_heading(h, name) for h in headings), f"no .SS for {name}"
        if _is_group(command):  # the group shows in its subcommands' lines
            assert f".B personaplex {name} " in synopsis, f"{name} not in SYNOPSIS"
        else:
            assert f".B personaplex {name}\n" in synopsis, f"{name} not in SYNOPSIS"


def test_every_option_is_documented(page):
    missing = sorted({f"{cmd} {opt}" for cmd, opt, _ in _options() if roff(opt) not in page})
    assert not missing, f"options missing from {MAN_PAGE.name}: {missing}"
    # ...and described: a .TP item under the command's own .SS or COMMON OPTIONS.
    undescribed = sorted({f"{cmd} {opt}" for cmd, opt, _ in _options()
                          if not _tagged_paragraphs(_where_documented(page, cmd), opt)})
    assert not undescribed, f"options without a .TP item for their command: {undescribed}"


def test_every_command_option_is_in_the_synopsis(page):
    synopsis = section(page, "SYNOPSIS")
    missing = sorted({f"{cmd} {opt}" for cmd, opt, param in _options()
                      if cmd != "personaplex" and opt.startswith("--") and opt != "--help"
                      and roff(opt) not in synopsis
                      and not any(roff(o) in synopsis for o in param.opts)})
    assert not missing, f"not in the SYNOPSIS: {missing}"
    # Each option in its own command's line, as a whole option (a short form will do).
    misplaced = sorted({f"{cmd} {opt}" for cmd, opt, param in _options()
                        if opt.startswith("--") and opt != "--help"
                        and not any(_mentions(_synopsis_of(page, cmd), o)
                                    for o in [*param.opts, *param.secondary_opts])})
    assert not misplaced, f"not in their command's SYNOPSIS line: {misplaced}"


def _enum_of(command, param) -> type[enum.Enum] | None:
    """The Enum an option takes: its default's type or, for an Optional option (default
    None), the annotation of the command function's parameter (plain `typing`, not Typer's
    parameter-type internals, which change between minor versions)."""
    if isinstance(param.default, enum.Enum):
        return type(param.default)
    callback = getattr(command, "callback", None)
    if callback is None or param.name is None:
        return None
    hints = typing.get_type_hints(inspect.unwrap(callback), include_extras=True)
    annotation = hints.get(param.name)
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    candidates = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        candidates = list(typing.get_args(annotation))
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, enum.Enum)),
                None)


def test_every_choice_is_documented(page):
    checked = set()
    for name, command, ctx in _commands():
        for param in command.get_params(ctx):
            if param.param_type_name != "option":
                continue
            members = _enum_of(command, param)
            if members is None:
                continue
            opt = param.opts[0]
            line = _synopsis_of(page, name)
            for member in members:
                checked.add((name, opt, member.value))
                assert rf"\fB{member.value}\fR" in page or f".B {member.value}" in page, (
                    f"{name} {opt}: choice {member.value!r} not in the man page")
                assert re.search(rf"(?<![\w-]){re.escape(member.value)}(?![\w-])", line), (
                    f"{name} {opt}: choice {member.value!r} not in its SYNOPSIS line")
    options = {(name, opt) for name, opt, _ in checked}
    assert {("encode", "--format"), ("decode", "--format"), ("decode", "--sample-format"),
            ("reply", "--sample-format"), ("reply", "--dtype"), ("talk", "--dtype"),
            ("doctor", "--dtype"), ("voices create", "--dtype")} <= options
    assert {v for n, o, v in checked if (n, o) == ("decode", "--format")} >= {
        "wav", "flac", "ogg", "opus", "raw"}
    assert len(checked) >= 5  # --format auto|mimi|npy, --sample-format s16|f32


def _default_text(default) -> list[str]:
    """How a default may be written in the page (roff-escaped)."""
    if isinstance(default, enum.Enum):
        default = default.value
    if isinstance(default, float):
        texts = [repr(default)] + ([str(int(default))] if default.is_integer() else [])
    else:
        texts = [str(default)]
    return [roff(t) for t in texts]


def test_every_default_is_documented(page):
    # A value option with a default (not a flag or a counter) names it in its description:
    # the word "default" and the value, in the .TP item under the command or COMMON OPTIONS.
    checked = 0
    missing = []
    for cmd, opt, param in _options():
        if (param.default is None or isinstance(param.default, bool) or param.count
                or getattr(param, "is_flag", False) or not opt.startswith("--")):
            continue
        checked += 1
        items = _tagged_paragraphs(_where_documented(page, cmd), opt)
        texts = _default_text(param.default)
        if not any(re.search(r"(?i)\bdefault", item)
                   and any(re.search(rf"(?<![\w.]){re.escape(t)}(?![\w]|\\-)", item)
                           for t in texts) for item in items):
            missing.append(f"{cmd} {opt} (default {param.default!r})")
    assert not missing, f"defaults not in the options' descriptions: {sorted(set(missing))}"
    assert checked >= 20


def test_every_environment_variable_is_documented(page):
    environment = section(page, "ENVIRONMENT")
    envvars = {param.envvar for _, _, param in _options() if param.envvar}
    assert envvars >= {"PERSONAPLEX_MODEL", "PERSONAPLEX_DEVICE"}
    for name in sorted(envvars) + ["HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN",
                                   "NO_COLOR", "XDG_CACHE_HOME", "PERSONAPLEX_VOICES_DIR",
                                   "HF_TOKEN_PATH", "HF_ENDPOINT", "XDG_DATA_HOME",
                                   "TYPER_USE_RICH"]:
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
    for ref in ("sox", "soxi", "ffmpeg", "hf", "zstd"):
        assert f".BR {ref} (1)" in see_also


def test_the_page_says_how_to_read_it_and_complete_it(page):
    assert _subsections(page, "help") and "MANPATH" in _subsections(page, "help")
    files = section(page, "FILES")
    for name in ("personaplex.bash", "_personaplex", "personaplex.fish"):
        assert name in files, f"completions/{name} not under FILES"
    assert roff("--install-completion") in section(page, "EXAMPLES")
    mimi = section(page, "THE .MIMI FORMAT")
    assert "MEND" in mimi and "bit 1" in mimi, "the .mimi trailer is not described"


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
