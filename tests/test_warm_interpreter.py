"""conftest's run_cli forks most runs from a warm interpreter (tests/cli_forks.py): a run so
started answers exactly as a fresh `python -m personaplex_cli` does, and what a fork cannot
honour goes to a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cli_forks import needs_fresh_interpreter


def fresh(cli_env, args, *, env=None, cwd=None, input=None):
    return subprocess.run([sys.executable, "-m", "personaplex_cli", *map(str, args)],
                          input=input, stdin=None if input is not None else subprocess.DEVNULL,
                          capture_output=True, env={**cli_env, **(env or {})}, cwd=cwd,
                          timeout=120)


def forked(warm_interpreter, cli_env, args, *, env=None, cwd=None, input=None, stdin=None,
           stdout=subprocess.PIPE, timeout=120):
    return warm_interpreter.run([str(arg) for arg in args], env={**cli_env, **(env or {})},
                                cwd=cwd, input=input, stdin=stdin, stdout=stdout,
                                timeout=timeout)


def test_a_forked_run_answers_as_a_fresh_one(warm_interpreter, cli_env, tiny_model_dir,
                                             speech_wav, tmp_path):
    """Exit status, stdout and stderr byte for byte: a success with binary output, errors
    found in the working folder, on stdin and in the environment, and a usage error."""
    (tmp_path / "here.wav").write_bytes(speech_wav.read_bytes())
    model = {"PERSONAPLEX_MODEL": str(tiny_model_dir), "PERSONAPLEX_DEVICE": "cpu"}
    cases = [
        (["--version"], {}, None),
        (["encode", "here.wav", "-o", "-"], model, None),  # relative to the run's folder
        (["encode", "missing.wav", "-o", "-"], model, None),
        (["decode", "-", "-o", "-"], model, b"not codes at all"),
        (["encode", "here.wav", "-o", "-"], {"PERSONAPLEX_MODEL": str(tmp_path / "none")},
         None),
        (["encode", "--no-such-option"], {}, None),
    ]
    codes = []
    for args, env, given in cases:
        want = fresh(cli_env, args, env=env, cwd=tmp_path, input=given)
        got = forked(warm_interpreter, cli_env, args, env=env, cwd=tmp_path, input=given)
        assert (got.returncode, got.stdout, got.stderr) == (
            want.returncode, want.stdout, want.stderr), args
        codes.append(got.returncode)
    assert codes[:3] == [0, 0, 7] and all(code != 0 for code in codes[3:])


def test_output_to_a_descriptor_and_a_run_past_its_timeout(warm_interpreter, cli_env,
                                                            tiny_model_dir, speech_wav,
                                                            tmp_path):
    model = {"PERSONAPLEX_MODEL": str(tiny_model_dir), "PERSONAPLEX_DEVICE": "cpu"}
    with open(tmp_path / "codes.mimi", "wb") as sink:
        got = forked(warm_interpreter, cli_env, ["encode", speech_wav, "-o", "-"], env=model,
                     stdout=sink.fileno())
    assert got.returncode == 0 and got.stdout is None
    want = fresh(cli_env, ["encode", speech_wav, "-o", "-"], env=model)
    assert (tmp_path / "codes.mimi").read_bytes() == want.stdout

    # decode waits for stdin that never ends: the run is killed at its timeout.
    read, write = os.pipe()
    try:
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            forked(warm_interpreter, cli_env, ["decode", "-", "-o", "-"], env=model,
                   stdin=read, timeout=2)
        assert time.monotonic() - started < 30
    finally:
        os.close(read)
        os.close(write)


def test_what_python_reads_at_start_needs_a_fresh_interpreter():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
    assert not needs_fresh_interpreter(dict(base), base)
    assert not needs_fresh_interpreter({**base, "PERSONAPLEX_MODEL": "/m", "HF_HOME": "/h"},
                                       base)
    for changed in ({**base, "OMP_NUM_THREADS": "2"}, {**base, "PYTHONPATH": "/p"},
                    {**base, "LD_PRELOAD": "x.so"}, {**base, "LANG": "C"},
                    {key: value for key, value in base.items() if key != "OMP_NUM_THREADS"}):
        assert needs_fresh_interpreter(changed, base), changed
