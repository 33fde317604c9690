"""What `pip install .` puts on a machine: the console script, the manual page where man(1)
finds it, the sample question; and `personaplex help`, which shows the page whatever MANPATH
says."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the project installed from its wheel; nothing is downloaded."""
    base = tmp_path_factory.mktemp("install")
    wheels = base / "wheels"
    # The build backend is setuptools, already in this environment: no network needed.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(ROOT)], check=True, capture_output=True,
                   timeout=300)
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    wheel = next(wheels.glob("personaplex_cli-*.whl"))
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # The dependencies: this environment's packages, appended to the new one's path (a
    # plain path line: the .pth files there, such as this checkout's editable hook, do not
    # run, so the wheel's own copy is the one imported).
    ours = next(env_dir.glob("lib/python*/site-packages"))
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (ours / "zz_test_dependencies.pth").write_text("\n".join(deps) + "\n")
    return env_dir


def test_the_wheel_installs_the_manual_page_and_the_sample(installed):
    page = installed / "share" / "man" / "man1" / "personaplex.1"
    assert page.read_bytes() == (ROOT / "man" / "personaplex.1").read_bytes()
    found = list(installed.glob("lib/python*/site-packages/personaplex_cli/samples/question.wav"))
    assert len(found) == 1 and found[0].stat().st_size > 100_000
    assert (installed / "bin" / "personaplex").is_file()
    # the kernels' sources, built on the machine that runs them (model/native.py)
    for name in ("rows.c", "rows_op.cpp"):
        [source] = installed.glob(f"lib/python*/site-packages/personaplex_cli/model/{name}")
        assert source.read_bytes() == (ROOT / "personaplex_cli" / "model" / name).read_bytes()


@pytest.mark.skipif(shutil.which("man") is None, reason="man-db is not installed")
def test_man_finds_the_page_through_path(installed):
    env = {**os.environ, "PATH": f"{installed / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MANPATH", None)
    proc = subprocess.run(["man", "-w", "personaplex"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == installed / "share" / "man" / "man1" / "personaplex.1"


def test_help_shows_the_page_whatever_manpath_says(installed, tmp_path):
    env = {**os.environ, "MANPATH": str(tmp_path), "PAGER": "cat", "MANPAGER": "cat",
           "COLUMNS": "100"}
    for personaplex in (installed / "bin" / "personaplex",  # installed: share/man
                        Path(sys.executable).parent / "personaplex"):  # a source checkout
        proc = subprocess.run([str(personaplex), "help"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "NAME" in proc.stdout and "EXIT STATUS" in proc.stdout
    imported = subprocess.run([str(installed / "bin" / "python"), "-c",
                               "import personaplex_cli; print(personaplex_cli.__file__)"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path).stdout
    assert Path(imported.strip()).resolve().is_relative_to(installed.resolve())
