"""The shell completion files in completions/ match what the installed CLI generates.

bash and fish files are Typer's own scripts (`_PERSONAPLEX_COMPLETE=source_bash|source_fish`);
the zsh file is hand-written so that, autoloaded from $fpath, its body is the completion
function (docs/cli-conventions.md §2.2). All three call back into `personaplex`, so each
TAB goes through the same code as these subprocesses.

To regenerate after changing the CLI:
    _PERSONAPLEX_COMPLETE=source_bash personaplex > completions/personaplex.bash
    _PERSONAPLEX_COMPLETE=source_fish personaplex > completions/personaplex.fish
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COMPLETIONS = Path(__file__).resolve().parents[1] / "completions"
ZSH_EVAL = ('eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" '
            '_PERSONAPLEX_COMPLETE=complete_zsh personaplex)')


@pytest.fixture(scope="module")
def personaplex() -> str:
    """The console script: completion keys off the program name, so `python -m` won't do."""
    script = Path(sys.executable).parent / "personaplex"
    if script.is_file():
        return str(script)
    found = shutil.which("personaplex")
    if found is None:
        pytest.skip("the personaplex script is not installed")
    return found


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("_PERSONAPLEX_", "_TYPER_", "COMP_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _run(cmd: list[str], **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=_env(**extra), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize("shell,name", [("bash", "personaplex.bash"),
                                        ("fish", "personaplex.fish")])
def test_committed_script_is_current(personaplex, shell, name):
    generated = _run([personaplex], _PERSONAPLEX_COMPLETE=f"source_{shell}").stdout
    committed = (COMPLETIONS / name).read_text()
    assert committed.rstrip("\n") == generated.rstrip("\n"), (
        f"completions/{name} is stale; regenerate it with "
        f"_PERSONAPLEX_COMPLETE=source_{shell} personaplex > completions/{name}")


def test_zsh_file_is_an_autoloadable_function_body():
    lines = (COMPLETIONS / "_personaplex").read_text().splitlines()
    assert lines[0] == "#compdef personaplex"
    assert lines[1] == ZSH_EVAL


def test_bash_protocol_completes_a_command(personaplex):
    proc = _run([personaplex], _PERSONAPLEX_COMPLETE="complete_bash",
                COMP_WORDS="personaplex en", COMP_CWORD="1")
    assert proc.stdout.split() == ["encode"]


def test_bash_protocol_completes_device_values(personaplex):
    proc = _run([personaplex], _PERSONAPLEX_COMPLETE="complete_bash",
                COMP_WORDS="personaplex decode --device ", COMP_CWORD="3")
    assert {"auto", "cpu", "cuda"} <= set(proc.stdout.split())


def test_zsh_protocol_completes_a_command(personaplex):
    # What the eval line in _personaplex runs for `personaplex en<TAB>`.
    proc = _run([personaplex], _PERSONAPLEX_COMPLETE="complete_zsh",
                _TYPER_COMPLETE_ARGS="personaplex en")
    assert '"encode"' in proc.stdout and '"decode"' not in proc.stdout


def test_fish_protocol_completes_a_command(personaplex):
    proc = _run([personaplex], _PERSONAPLEX_COMPLETE="complete_fish",
                _TYPER_COMPLETE_FISH_ACTION="get-args", _TYPER_COMPLETE_ARGS="personaplex de")
    assert [line.split("\t")[0] for line in proc.stdout.splitlines()] == ["decode"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_sourced_bash_script_in_a_real_shell():
    script = (f"source {COMPLETIONS / 'personaplex.bash'}\n"
              "COMP_WORDS=(personaplex en); COMP_CWORD=1\n"
              "_personaplex_completion personaplex\n"
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    proc = _run(["bash", "--norc", "--noprofile", "-c", script])
    assert proc.stdout.split() == ["encode"]


def test_voice_names_complete_from_the_user_and_the_model(personaplex, tmp_path):
    """`--voice` and `voices show` (issue 13.10) complete the user's voices and those of the
    model named so far: --model on the line, else PERSONAPLEX_MODEL."""
    own = tmp_path / "voices"
    own.mkdir()
    (own / "Nancy.pt").write_bytes(b"")
    model = tmp_path / "model"
    (model / "voices").mkdir(parents=True)
    (model / "voices" / "NATX9.pt").write_bytes(b"")
    for words, env_model in (("personaplex reply --voice N", model),
                             ("personaplex voices show N", model),
                             ("personaplex voices show N", None),
                             (f"personaplex voices show --model {model} N", None),
                             (f"personaplex talk -m {model} --voice N", None)):
        env = {"PERSONAPLEX_MODEL": str(env_model)} if env_model else {}
        proc = _run([personaplex], _PERSONAPLEX_COMPLETE="complete_bash", COMP_WORDS=words,
                    COMP_CWORD=str(len(words.split()) - 1), PERSONAPLEX_VOICES_DIR=str(own),
                    **env)
        names = set(proc.stdout.split())
        assert {"NATF0", "NATM3", "Nancy"} <= names, words
        assert ("NATX9" in names) == (str(model) in words or env_model is not None), words
        assert all(name.startswith("N") for name in names)


def test_dtypes_complete(personaplex):
    proc = _run([personaplex], _PERSONAPLEX_COMPLETE="complete_bash",
                COMP_WORDS="personaplex reply --dtype ", COMP_CWORD="3")
    assert proc.stdout.split() == ["bf16", "fp16", "fp32"]


def test_quantizations_and_compile_modes_complete(personaplex):
    proc = _run([personaplex], _PERSONAPLEX_COMPLETE="complete_bash",
                COMP_WORDS="personaplex reply --quantize ", COMP_CWORD="3")
    assert proc.stdout.split() == ["none", "int8", "int8-weights", "int4", "fp8"]
    proc = _run([personaplex], _PERSONAPLEX_COMPLETE="complete_bash",
                COMP_WORDS="personaplex serve --compile ", COMP_CWORD="3")
    assert proc.stdout.split() == ["auto", "on", "off"]


def test_completing_a_voice_imports_nothing_heavy(personaplex, tmp_path):
    probe = ("import sys, runpy; sys.argv = ['personaplex'];\n"
             "try:\n    runpy.run_module('personaplex_cli', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "heavy = {'torch', 'numpy', 'soundfile', 'sounddevice', 'huggingface_hub'}\n"
             "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))")
    proc = _run([sys.executable, "-c", probe], _PERSONAPLEX_COMPLETE="complete_bash",
                COMP_WORDS="personaplex reply --voice N", COMP_CWORD="3")
    assert proc.stdout.strip().splitlines()[-1] == "[]"

