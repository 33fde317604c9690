"""End-to-end tests of the `personaplex` command (encode, decode) as a user runs it.

Anything that moves data through stdin/stdout runs the CLI as a subprocess on real pipes
(CliRunner's stdio are seekable in-memory buffers, which hides pipe bugs); CliRunner is
used only for help and version output. All runs use a tiny random-weight Mimi, on CPU.

Each run pays ~1.5 s of interpreter + torch start-up, so the independent runs are started
together in a small thread pool (`batch`) and each test waits only for the runs it checks;
the few runs that depend on an earlier one's output stay inside their test.
The bad-input cases of every command are in test_errors.py.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import math
import os
import pty
import re
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from typer.testing import CliRunner

from conftest import SAMPLE_RATE, mimi_with_header, speech_like
from personaplex_cli import __version__, errors
from personaplex_cli.cli.app import app

N_SAMPLES = 36000  # speech_wav: 1.5 s at 24 kHz
N_FRAMES = math.ceil(N_SAMPLES / 1920)  # 19
FRAME_TOLERANCE_16K = 1920 * 16000 // 24000  # one Mimi frame at 16 kHz


# --- helpers ------------------------------------------------------------------------------


def _personaplex_command() -> str:
    """The installed `personaplex` script next to this interpreter, else `python -m`."""
    script = Path(sys.executable).parent / "personaplex"
    if script.is_file() and os.access(script, os.X_OK):
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m personaplex_cli"


PERSONAPLEX = _personaplex_command()


def parse_mimi(data: bytes) -> tuple[dict, int | None, np.ndarray]:
    """-> (JSON header, num_frames from the preamble or None, codes [K, frames])."""
    magic, version, flags, _, json_len, num_frames = struct.unpack_from("<4sBBHIQ", data)
    assert (magic, version) == (b"MIMI", 1)
    header = json.loads(data[20:20 + json_len])
    body = np.frombuffer(data[20 + json_len:], "<u2")
    codes = body.reshape(-1, header["num_codebooks"]).T
    return header, (num_frames if flags & 1 else None), codes


def assert_clean_error(proc: subprocess.CompletedProcess, code: int) -> None:
    """The documented exit code and exactly one `personaplex: error:` line, no traceback."""
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}; stderr: {stderr}"
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("personaplex: error:"), stderr


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")
    assert b"Traceback" not in proc.stderr


def write_wav_in_blocks(path: Path, seconds: int, block_seconds: int = 10) -> None:
    """A long 24 kHz s16 WAV written block by block (never the whole signal in memory)."""
    rng = np.random.default_rng(7)
    t = np.arange(block_seconds * SAMPLE_RATE) / SAMPLE_RATE
    with sf.SoundFile(path, "w", SAMPLE_RATE, 1, "PCM_16") as f:
        for i in range(seconds // block_seconds):
            block = 0.3 * np.sin(2 * np.pi * (150 + 10 * i) * t) * (0.6 + 0.4 * np.sin(np.pi * t))
            f.write((block + 0.01 * rng.standard_normal(len(t))).astype(np.float32))


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_env(tiny_model_dir) -> dict[str, str]:
    return {"PERSONAPLEX_MODEL": str(tiny_model_dir), "PERSONAPLEX_DEVICE": "cpu"}


@pytest.fixture(scope="module")
def cli(run_cli, model_env):
    """run_cli with the tiny model and CPU selected through the environment."""

    def run(*args, env: dict | None = None, **kwargs):
        return run_cli(*args, env={**model_env, **(env or {})}, **kwargs)

    return run


@pytest.fixture(scope="module")
def shell(cli_env, model_env):
    """Run a bash script with the CLI's environment; -> CompletedProcess (bytes)."""

    def run(script: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**cli_env, **model_env}
        return subprocess.run(["bash", "-c", script], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                              timeout=timeout)

    return run


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, cli, speech_wav) -> Path:
    """speech_wav encoded by the CLI into a .mimi file (8 codebooks)."""
    path = tmp_path_factory.mktemp("encoded") / "speech.mimi"
    assert_ok(cli("encode", speech_wav, "-o", path))
    return path


class Batch:
    """Jobs run in a thread pool; `batch[name]` waits for one and returns its result."""

    def __init__(self, root: Path, workers: int):
        self.root = root
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        self._futures: dict[str, concurrent.futures.Future] = {}

    def dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def submit(self, name: str, fn, *args, **kwargs) -> None:
        self._futures[name] = self._pool.submit(fn, *args, **kwargs)

    def __getitem__(self, name: str):
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _quote(path) -> str:
    return shlex.quote(str(path))


OUT = object()  # stands for a job's output file in its argument list


@pytest.fixture(scope="module")
def batch(tmp_path_factory, cli, shell, speech_wav, speech_wav_44k_stereo, encoded):
    """Starts every independent CLI run of this module; tests read their results."""
    b = Batch(tmp_path_factory.mktemp("batch"), workers=max(2, min(4, os.cpu_count() or 2)))

    def run_cli_job(name: str, args: list, out: str | None, kwargs: dict):
        path = b.dir(name) / out if out else None
        return cli(*[path if a is OUT else a for a in args], **kwargs), path

    def cli_job(name: str, *args, out: str | None = None, **kwargs) -> None:
        """Job `name` -> (proc, path of OUT): `out` names OUT inside the job's directory."""
        b.submit(name, run_cli_job, name, args, out, kwargs)

    def shell_job(name: str, script: str) -> None:
        """Job `name` -> (proc, the job's directory, which `{dir}` in `script` names)."""
        folder = b.dir(name)
        b.submit(name, lambda: (shell(script.format(dir=_quote(folder))), folder))

    cli_job("decoded-s16", "decode", encoded, "-o", OUT, out="y.wav")
    shell_job("pipeline",
              f"{PERSONAPLEX} encode {_quote(speech_wav)} -o - | tee {{dir}}/codes.mimi "
              f"| {PERSONAPLEX} decode - -o {{dir}}/y.wav; " + 'echo "${{PIPESTATUS[@]}}"')
    cli_job("raw", "decode", encoded, "--raw", "-o", "-")
    cli_job("rate-16k", "decode", encoded, "--rate", "16000", "-o", OUT, out="y.wav")
    cli_job("f32", "decode", encoded, "--sample-format", "f32", "-o", OUT, out="y.wav")
    cli_job("stereo-44k1", "encode", speech_wav_44k_stereo, "-o", OUT, out="st.mimi")
    cli_job("k4", "encode", speech_wav, "--codebooks", "4", "-o", OUT, out="k4.mimi")
    cli_job("npy-suffix", "encode", speech_wav, "-o", OUT, out="codes.npy")
    cli_job("npy-format", "encode", speech_wav, "--format", "npy", "-o", "-")
    shell_job("wav-stdin", f"cat {_quote(speech_wav)} | {PERSONAPLEX} encode - -o {{dir}}/out.mimi")
    samples, rate = sf.read(speech_wav, dtype="int16")
    flac = b.dir("flac-stdin") / "speech.flac"
    sf.write(flac, samples, rate, format="FLAC", subtype="PCM_16")
    # No -o: with IN on stdin the codes go to stdout.
    cli_job("flac-stdin", "encode", "-", input=flac.read_bytes())
    other = b.dir("ignore-weights") / "other.mimi"
    other.write_bytes(mimi_with_header(encoded.read_bytes(), weights_sha256="0" * 64))
    cli_job("ignore-weights", "decode", other, "--ignore-weights", "-o", OUT, out="y.wav")
    # Long enough that encode is still writing well after `head` has gone (its whole
    # output would fit in the pipe buffer, so only a closed pipe can stop it).
    long_wav = b.dir("sigpipe") / "long.wav"
    write_wav_in_blocks(long_wav, 60)
    shell_job("sigpipe", f"{PERSONAPLEX} encode {_quote(long_wav)} -o - 2>{{dir}}/err.txt "
                         '| head -c 100 >/dev/null; echo "${{PIPESTATUS[0]}}"')
    yield b
    b.close()


@pytest.fixture(scope="module")
def decoded_s16(batch) -> Path:
    """The CLI's s16 WAV decoding of `encoded`."""
    proc, path = batch["decoded-s16"]
    assert_ok(proc)
    return path


# --- round trips ----------------------------------------------------------------------------


def test_encode_decode_through_a_shell_pipe(batch, encoded, decoded_s16):
    proc, folder = batch["pipeline"]
    assert proc.stdout.split() == [b"0", b"0", b"0"], proc.stderr.decode()  # encode tee decode
    assert b"Traceback" not in proc.stderr
    out = folder / "y.wav"
    info = sf.info(out)
    assert (info.samplerate, info.channels, info.frames) == (SAMPLE_RATE, 1, N_SAMPLES)
    data = out.read_bytes()
    # Exact sizes in the header from the first byte (the length was known up front).
    assert struct.unpack_from("<I", data, 4)[0] == len(data) - 8
    assert data[36:40] == b"data" and struct.unpack_from("<I", data, 40)[0] == 2 * N_SAMPLES
    # A pipe changes nothing: same codes and audio as file -> file -> file.
    header, num_frames, codes = parse_mimi((folder / "codes.mimi").read_bytes())
    file_header, file_frames, file_codes = parse_mimi(encoded.read_bytes())
    assert header == file_header
    assert num_frames == file_frames == N_FRAMES
    np.testing.assert_array_equal(codes, file_codes)
    assert data == decoded_s16.read_bytes()


def test_default_output_names(tmp_path, cli, speech_wav):
    shutil.copy(speech_wav, tmp_path / "talk.wav")
    original = (tmp_path / "talk.wav").read_bytes()

    proc = cli("encode", "talk.wav", cwd=tmp_path)
    assert_ok(proc)
    assert proc.stdout == b""
    assert (tmp_path / "talk.mimi").read_bytes()[:4] == b"MIMI"

    # The decode of talk.mimi is never talk.wav, the recording it came from (also with -f).
    assert_ok(cli("decode", "talk.mimi", "-f", cwd=tmp_path))
    assert (tmp_path / "talk.wav").read_bytes() == original
    assert sf.info(tmp_path / "talk.decoded.wav").frames == N_SAMPLES
    assert_ok(cli("decode", "talk.mimi", "--format", "flac", cwd=tmp_path))
    assert sf.info(tmp_path / "talk.decoded.flac").format == "FLAC"

    assert_ok(cli("encode", "talk.wav", "--format", "npy", cwd=tmp_path))
    assert np.load(tmp_path / "talk.npy").shape == (8, N_FRAMES)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["talk.decoded.flac", "talk.decoded.wav", "talk.mimi", "talk.npy",
                     "talk.wav"]


def test_npy_by_suffix_and_by_format(tmp_path, batch, cli, encoded, decoded_s16):
    _, _, mimi_codes = parse_mimi(encoded.read_bytes())
    proc, npy = batch["npy-suffix"]
    assert_ok(proc)
    codes = np.load(npy)
    assert codes.dtype == np.uint16 and codes.shape == (8, N_FRAMES)
    np.testing.assert_array_equal(codes, mimi_codes)

    proc, _ = batch["npy-format"]
    assert_ok(proc)
    np.testing.assert_array_equal(np.load(io.BytesIO(proc.stdout)), mimi_codes)

    out = tmp_path / "from-npy.wav"
    assert_ok(cli("decode", npy, "-o", out))
    audio, rate = sf.read(out, dtype="int16")
    # .npy records no length: whole frames come out, starting with the same samples.
    assert rate == SAMPLE_RATE and len(audio) == N_FRAMES * 1920
    reference, _ = sf.read(decoded_s16, dtype="int16")
    np.testing.assert_array_equal(audio[:N_SAMPLES], reference)


def test_four_codebooks(tmp_path, batch, cli, encoded):
    proc, path = batch["k4"]
    assert_ok(proc)
    header, num_frames, codes = parse_mimi(path.read_bytes())
    assert header["num_codebooks"] == 4 and num_frames == N_FRAMES
    assert codes.shape == (4, N_FRAMES)
    # Residual quantisation: fewer codebooks = the first rows of the full codes.
    np.testing.assert_array_equal(codes, parse_mimi(encoded.read_bytes())[2][:4])

    out = tmp_path / "k4.wav"
    assert_ok(cli("decode", path, "-o", out))
    info = sf.info(out)
    assert (info.samplerate, info.channels, info.frames) == (SAMPLE_RATE, 1, N_SAMPLES)


def test_raw_output(batch, decoded_s16):
    proc, _ = batch["raw"]
    assert_ok(proc)
    assert len(proc.stdout) == 2 * N_SAMPLES
    assert proc.stdout == decoded_s16.read_bytes()[44:]


def test_rate_16k(batch):
    proc, out = batch["rate-16k"]
    assert_ok(proc)
    info = sf.info(out)
    assert (info.samplerate, info.channels) == (16000, 1)
    assert abs(info.frames - 16000 * N_SAMPLES // SAMPLE_RATE) <= FRAME_TOLERANCE_16K
    # The header was patched to the real length (the file is seekable).
    data = out.read_bytes()
    assert struct.unpack_from("<I", data, 40)[0] == len(data) - 44


def test_f32_is_bit_exact_and_s16_is_rounded(batch, encoded, decoded_s16, tiny_model_dir):
    import torch

    from personaplex_cli.codec import decode_stream
    from personaplex_cli.codes import CodeReader
    from personaplex_cli.model.load import load_mimi_from_dir

    proc, out = batch["f32"]
    assert_ok(proc)
    assert sf.info(out).subtype == "FLOAT"
    got, rate = sf.read(out, dtype="float32")
    assert rate == SAMPLE_RATE

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the subprocess (OMP_NUM_THREADS=1)
    try:
        mimi, _ = load_mimi_from_dir(tiny_model_dir, torch.device("cpu"))
        with open(encoded, "rb") as f:
            reader = CodeReader(f)
            parts: list[np.ndarray] = []
            decode_stream(mimi, reader.frames(max_frames=25), parts.append,
                          num_samples=reader.header.num_samples)
    finally:
        torch.set_num_threads(threads)
    expected = np.concatenate(parts).astype(np.float32)
    assert len(expected) == N_SAMPLES
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))

    s16, _ = sf.read(decoded_s16, dtype="int16")
    np.testing.assert_array_equal(s16, np.round(np.clip(expected, -1, 1) * 32767).astype(np.int16))


def test_44k1_stereo_input(batch, speech_wav_44k_stereo):
    proc, out = batch["stereo-44k1"]
    assert_ok(proc)
    header, num_frames, codes = parse_mimi(out.read_bytes())
    duration = sf.info(speech_wav_44k_stereo).duration
    assert num_frames == codes.shape[1] == math.ceil(duration * 12.5) == N_FRAMES
    assert abs(header["num_samples"] - round(duration * SAMPLE_RATE)) <= 1


def test_wav_on_stdin_through_cat(batch, encoded):
    proc, folder = batch["wav-stdin"]
    assert_ok(proc)
    header, num_frames, codes = parse_mimi((folder / "out.mimi").read_bytes())
    assert header["num_samples"] == N_SAMPLES and num_frames == N_FRAMES
    np.testing.assert_array_equal(codes, parse_mimi(encoded.read_bytes())[2])


def test_flac_on_stdin_to_stdout(batch, encoded):
    proc, _ = batch["flac-stdin"]
    assert_ok(proc)
    header, _, codes = parse_mimi(proc.stdout)
    assert header["num_codebooks"] == 8
    # Lossless: the same samples as the WAV, so the same codes.
    np.testing.assert_array_equal(codes, parse_mimi(encoded.read_bytes())[2])


def test_code_file_header(encoded, tiny_model_dir):
    header, num_frames, codes = parse_mimi(encoded.read_bytes())
    assert header["num_samples"] == N_SAMPLES
    assert header["num_codebooks"] == 8 and codes.shape == (8, N_FRAMES)
    assert num_frames == N_FRAMES
    assert re.fullmatch(r"[0-9a-f]{64}", header["weights_sha256"])
    checkpoint = next(tiny_model_dir.glob("tokenizer-*.safetensors"))
    assert header["weights_sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    assert header["tool"] == f"personaplex {__version__}"
    assert header["window"] == "kyutai"  # encode's attention window rule, decode's default


def test_other_weights_decode_with_ignore_weights(batch):
    # Without --ignore-weights this is refused: tests/test_errors.py, decode-mimi-other-weights.
    proc, out = batch["ignore-weights"]
    assert_ok(proc)
    assert sf.info(out).frames == N_SAMPLES


def test_reader_going_away_exits_141(batch):
    proc, folder = batch["sigpipe"]
    stderr = (folder / "err.txt").read_text(errors="replace")
    assert proc.stdout.split() == [b"141"], stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


# --- terminals and pipes --------------------------------------------------------------------


def test_binary_output_to_a_terminal_is_refused(cli, speech_wav, encoded):
    master, slave = pty.openpty()
    try:
        for args, stdin in ((["encode", speech_wav, "-o", "-"], None),
                            (["decode", encoded, "-o", "-"], None),
                            (["encode", "-"], speech_wav.read_bytes())):  # default: stdout
            proc = cli(*args, input=stdin, stdout=slave)
            assert_clean_error(proc, errors.EXIT_OUTPUT)
            assert b"terminal" in proc.stderr
        # Nor is a terminal accepted as the input.
        proc = cli("encode", "-", "-o", "-", stdin=slave)
        assert_clean_error(proc, errors.EXIT_BAD_INPUT)
    finally:
        os.close(master)
        os.close(slave)


# --- help, version, import cost ------------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["encode", "--help"], ["decode", "--help"]])
def test_help(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"personaplex {__version__}\n"
    assert __version__ == "0.1.0"


def _float_options():
    """(command words, option) for every option of the app that takes a float (from the
    command functions' annotations, not Typer's internals)."""
    import inspect
    import typing

    import typer

    def takes_float(command, name) -> bool:
        hints = typing.get_type_hints(inspect.unwrap(command.callback), include_extras=True)
        annotation = hints.get(name)
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        return annotation is float or float in typing.get_args(annotation)

    def walk(command, words):
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*words, name])
        for param in getattr(command, "params", []):
            if param.param_type_name == "option" and takes_float(command, param.name):
                yield words, param.opts[0]

    return list(walk(typer.main.get_command(app), []))


def test_every_float_option_refuses_nan_and_inf():
    """One check for every number option (issue 13): the real reason, not Typer's
    "should be greater than or equal to 0" for nan, and inf refused."""
    options = _float_options()
    assert {(" ".join(w), o) for w, o in options} >= {
        ("reply", "--temperature"), ("reply", "--audio-temperature"), ("talk", "--buffer"),
        ("reply", "--tail-silence"), ("talk", "--temperature"), ("talk", "--duration")}
    for words, option in options:
        arguments = ["x.wav", "y.wav"] if words == ["reply"] else []
        for value, reason in (("nan", "nan is not a number"),
                              ("inf", "must be a finite number, not inf"),
                              ("-inf", "must be a finite number, not -inf")):
            result = CliRunner().invoke(app, [*words, *arguments, option, value],
                                        env={"COLUMNS": "300"})
            assert result.exit_code == 2, (words, option, value, result.output)
            assert reason in " ".join(result.output.split()), (words, option, result.output)


HEAVY_MODULES = ("torch", "numpy", "soundfile", "sounddevice", "scipy", "huggingface_hub",
                 "starlette", "uvicorn", "websockets", "sphn", "ray", "fastapi", "pyarrow")

_IMPORT_PROBE = """
import json, os, sys
argv = json.loads(os.environ["PROBE_ARGV"])
try:
    from personaplex_cli.cli.app import main
    if argv is not None:
        sys.argv = ["personaplex", *argv]
        main()
except SystemExit:
    pass
heavy = json.loads(os.environ["PROBE_HEAVY"])
loaded = sorted({m.split(".")[0] for m in list(sys.modules)} & set(heavy))
with open(os.environ["PROBE_RESULT"], "w") as f:
    json.dump(loaded, f)
"""


@pytest.mark.parametrize("argv,extra_env", [
    (None, {}),
    (["--help"], {}),
    (["encode", "--help"], {}),
    (["decode", "--help"], {}),
    (["serve", "--help"], {}),
    (["reply", "--help"], {}),
    (["--version"], {}),
    ([], {"_PERSONAPLEX_COMPLETE": "complete_bash", "COMP_WORDS": "personaplex encode --dev",
          "COMP_CWORD": "2"}),
], ids=["import", "help", "encode-help", "decode-help", "serve-help", "reply-help", "version",
        "tab-completion"])
def test_cli_startup_imports_nothing_heavy(tmp_path, cli_env, argv, extra_env):
    result = tmp_path / "loaded.json"
    env = {**cli_env, **extra_env, "PROBE_ARGV": json.dumps(argv),
           "PROBE_HEAVY": json.dumps(HEAVY_MODULES), "PROBE_RESULT": str(result)}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()
    assert json.loads(result.read_text()) == []


# --- memory -----------------------------------------------------------------------------------


def _peak_rss_mb(cmd: list, env: dict, stdin=subprocess.DEVNULL) -> float:
    """Peak resident memory of one child process (os.wait4 gives that child's own rusage)."""
    proc = subprocess.Popen(cmd, env=env, stdin=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr.close()
    assert proc.returncode == 0, stderr.decode()
    return usage.ru_maxrss / 1024  # KiB on Linux


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units differ")
def test_memory_stays_flat_on_long_input(tmp_path, cli_env, model_env, record_property):
    env = {**cli_env, **model_env}
    encode = [sys.executable, "-m", "personaplex_cli", "encode"]
    short, long = tmp_path / "1min.wav", tmp_path / "10min.wav"
    write_wav_in_blocks(short, 60)
    write_wav_in_blocks(long, 600)
    outputs = {"1 min file": tmp_path / "1min.mimi", "10 min file": tmp_path / "10min.mimi",
               "10 min stdin": tmp_path / "10min-stdin.mimi"}
    with open(long, "rb") as stdin, concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {
            "1 min file": pool.submit(_peak_rss_mb, [*encode, short, "-o", outputs["1 min file"]],
                                      env),
            "10 min file": pool.submit(_peak_rss_mb,
                                       [*encode, long, "-o", outputs["10 min file"]], env),
        }
        runs["1 min file"].result()  # then the streaming WAV parser that stdin goes through
        runs["10 min stdin"] = pool.submit(
            _peak_rss_mb, [*encode, "-", "-o", outputs["10 min stdin"]], env, stdin)
        peaks = {name: run.result() for name, run in runs.items()}
    for name, out in outputs.items():
        seconds = 60 if name.startswith("1 ") else 600
        header, num_frames, codes = parse_mimi(out.read_bytes())
        assert header["num_samples"] == seconds * SAMPLE_RATE
        assert num_frames == codes.shape[1] == seconds * 25 // 2
    record_property("peak_rss_mb", peaks)
    print("\npeak RSS (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()))
    # 10 min of audio held as float32 takes 55 MiB (float64: 110 MiB), so a bound of
    # +60 MiB over the 1 min run fails if the input is held whole more than once.
    baseline = peaks["1 min file"]
    assert peaks["10 min file"] - baseline < 60, peaks
    assert peaks["10 min stdin"] - baseline < 60, peaks


# --- what a new user hit (issue 6) ------------------------------------------------------------


def _resampled(n: int, rate: int) -> int:
    from personaplex_cli.audio.resample import resampled_length

    return resampled_length(n, rate, SAMPLE_RATE)


def _wav_bytes(x: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def test_outputs_that_are_not_regular_files(tmp_path, cli, shell, speech_wav, encoded):
    # /dev/null needs no --force and stays the null device.
    assert_ok(cli("encode", speech_wav, "-o", "/dev/null"))
    assert_ok(cli("decode", encoded, "-o", "/dev/null", "-f"))
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    # A copy of the null device (made with mknod, as a user might) is written into, not
    # replaced by a regular file.
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    assert_ok(cli("decode", encoded, "-o", node, "-f"))
    assert stat.S_ISCHR(os.stat(node).st_mode)
    # A FIFO's reader gets the whole stream.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = shell(f"cat {_quote(fifo)} > {_quote(tmp_path / 'got.mimi')} & "
                 f"{PERSONAPLEX} encode {_quote(speech_wav)} -o {_quote(fifo)}; wait")
    assert proc.returncode == 0, proc.stderr.decode()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert parse_mimi((tmp_path / "got.mimi").read_bytes())[2].shape == (8, N_FRAMES)
    # /dev/stdout is our stdout; a process substitution is a pipe.
    proc = shell(f"{PERSONAPLEX} encode {_quote(speech_wav)} -o /dev/stdout | wc -c")
    assert int(proc.stdout) == len(encoded.read_bytes()), proc.stderr.decode()
    proc = shell(f"{PERSONAPLEX} encode {_quote(speech_wav)} "
                 f"-o >(cat > {_quote(tmp_path / 'sub.mimi')}); sleep 0.5")
    assert proc.returncode == 0, proc.stderr.decode()
    assert parse_mimi((tmp_path / "sub.mimi").read_bytes())[2].shape == (8, N_FRAMES)


def test_the_readme_pipeline_keeps_the_length(tmp_path, shell):
    cases = {
        "speech-22k.wav": (speech_like(6.43, 22050), 22050, "PCM_16"),  # espeak's rate
        "float-24k.wav": (speech_like(290111 / 24000), 24000, "FLOAT"),
        "stereo-44k.wav": (np.stack([speech_like(2.1, 44100)] * 2, axis=1), 44100, "PCM_16"),
    }
    for name, (x, rate, subtype) in cases.items():
        path = tmp_path / name
        sf.write(path, x, rate, subtype=subtype)
        want = _resampled(len(x), rate)
        for script in (f"{PERSONAPLEX} encode {{i}} -o - | {PERSONAPLEX} decode - -o {{o}}",
                       f"{PERSONAPLEX} encode - -o - < {{i}} | {PERSONAPLEX} decode - -o - > {{o}}"):
            out = tmp_path / "out.wav"
            proc = shell(script.format(i=_quote(path), o=_quote(out)))
            assert proc.returncode == 0, proc.stderr.decode()
            assert sf.info(out).frames == want, (name, script)
            out.unlink()


def test_a_stream_of_unknown_length_keeps_its_length(tmp_path, shell):
    """A WAV on a pipe whose header says "unknown size": the count travels in the .mimi
    trailer, so the pipe still decodes to the exact length."""
    x = speech_like(1.37, 16000)
    data = bytearray(_wav_bytes(x, 16000))
    struct.pack_into("<I", data, 4, 0xFFFFFFFF)
    struct.pack_into("<I", data, 40, 0xFFFFFFFF)
    (tmp_path / "stream.wav").write_bytes(bytes(data))
    proc = shell(f"cat {_quote(tmp_path / 'stream.wav')} | {PERSONAPLEX} encode - -o - "
                 f"| tee {_quote(tmp_path / 'c.mimi')} | {PERSONAPLEX} decode - -o - "
                 f"> {_quote(tmp_path / 'y.wav')}")
    assert proc.returncode == 0, proc.stderr.decode()
    header, _, _ = parse_mimi((tmp_path / "c.mimi").read_bytes()[:-21])
    assert header["num_samples"] is None  # not known when the header was written...
    assert sf.info(tmp_path / "y.wav").frames == _resampled(len(x), 16000)  # ...but at the end


def test_a_wav_shorter_than_its_header(tmp_path, cli, speech_wav):
    """A file cut short is broken; on a pipe the header's length is an estimate (issue 13):
    the stream is read to its end, with one warning."""
    data = speech_wav.read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(data[:44 + (len(data) - 44) // 2])
    proc = cli("encode", cut, "-o", tmp_path / "x.mimi")
    assert_clean_error(proc, errors.EXIT_BAD_INPUT)
    assert b"truncated WAV" in proc.stderr and b"1.50 s" in proc.stderr
    assert b"cut.wav" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.wav"]

    proc = cli("encode", "-", "-o", tmp_path / "x.mimi", input=cut.read_bytes())
    assert_ok(proc)
    assert proc.stderr.decode().splitlines() == [
        "personaplex: warning: stdin ends after 0.75 s of the 1.50 s its WAV header "
        "declares, a length that writers on a pipe can only estimate; using the 0.75 s it "
        "holds"]
    header, num_frames, codes = parse_mimi((tmp_path / "x.mimi").read_bytes())
    assert header["num_samples"] == N_SAMPLES // 2 and num_frames == math.ceil(N_SAMPLES / 3840)


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (.ci/run installs it: the README pipes through it)"
    return path


MP3 = Path(__file__).parent / "data" / "audio" / "speech-22k-mono-cbr.mp3"


def test_sox_and_ffmpeg_pipe_into_encode(tmp_path, shell):
    """The README's pipelines with the real tools. sox converting an MP3 to a pipe declares
    the length it estimates (here 1128 bytes more than it sends), ffmpeg "unknown": either
    way the codes are those of the same conversion written to a file."""
    sox, ffmpeg = _tool("sox"), _tool("ffmpeg")
    for name, to_pipe, to_file in (
            ("sox", f"{sox} {_quote(MP3)} -t wav -", f"{sox} {_quote(MP3)} {{o}}"),
            ("ffmpeg", f"{ffmpeg} -nostdin -loglevel error -i {_quote(MP3)} -f wav -",
             f"{ffmpeg} -nostdin -loglevel error -i {_quote(MP3)} {{o}}")):
        wav, piped, filed = (tmp_path / f"{name}{suffix}" for suffix in (".wav", "-pipe.mimi",
                                                                          "-file.mimi"))
        assert shell(to_file.format(o=_quote(wav))).returncode == 0
        proc = shell(f"{to_pipe} | {PERSONAPLEX} encode - -o {_quote(piped)}")
        assert proc.returncode == 0, proc.stderr.decode()
        warnings = proc.stderr.decode().splitlines()
        assert_ok(shell(f"{PERSONAPLEX} encode {_quote(wav)} -o {_quote(filed)}"))
        header, num_frames, codes = parse_mimi(piped.read_bytes())
        file_header, file_frames, file_codes = parse_mimi(filed.read_bytes())
        assert header["num_samples"] == file_header["num_samples"] == _resampled(
            sf.info(wav).frames, 22050)
        assert num_frames == file_frames
        np.testing.assert_array_equal(codes, file_codes)
        if name == "sox":
            assert len(warnings) == 1 and "its WAV header declares" in warnings[0], warnings
        else:
            assert warnings == []


@pytest.mark.parametrize("args,needle", [
    (["encode", "x.wav", "--codebooks", "0"], "--codebooks"),
    (["encode", "x.wav", "--format", "wav"], "'auto', 'mimi', 'npy'"),
    (["decode", "x.mimi", "--format", "mp4"], "'wav', 'flac', 'ogg', 'opus', 'raw'"),
    (["encode", "x.wav", "--verbose", "2"], "unexpected extra argument"),
    (["encode"], None),
    (["bogus"], "No such command"),
])
def test_usage_errors_are_one_line(cli, tmp_path, args, needle):
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == errors.EXIT_USAGE
    stderr = proc.stderr.decode()
    assert "╭" not in stderr and "Traceback" not in stderr
    if needle is None:  # no arguments at all: how to call it, and where the help is
        assert stderr.splitlines() == ["personaplex: error: missing arguments",
                                       f"Usage: personaplex {args[0]} [OPTIONS] IN",
                                       f"Try 'personaplex {args[0]} -h' for help."]
        return
    lines = stderr.strip().splitlines()
    assert len(lines) == 2, stderr
    assert lines[0].startswith("personaplex: error: ") and needle in lines[0]
    assert lines[1].startswith("Try 'personaplex") and lines[1].endswith("-h' for help.")


def _command_words() -> list[list[str]]:
    """Every command of the app as typed, groups and their subcommands included."""
    import typer

    def walk(command, words):
        yield words
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*words, name])

    return list(walk(typer.main.get_command(app), []))


def test_usage_lines_name_the_arguments_in_capitals():
    """As a command line reads (issue 13): `IN... OUT`, not Typer's `{IN... OUT}...`."""
    usage = {}
    for words in _command_words():
        text = CliRunner().invoke(app, [*words, "-h"], env={"COLUMNS": "200"}).stdout
        usage[" ".join(words)] = next(line.strip() for line in text.splitlines()
                                      if "Usage:" in line)
    assert len(usage) >= 12
    assert not [line for line in usage.values() if "{" in line or "}" in line], usage
    # reply's are optional: a --manifest names the inputs and outputs instead.
    for command, arguments in (("reply", "[IN... OUT]"), ("encode", "IN"), ("decode", "IN"),
                               ("voices show", "NAME"), ("voices create", "RECORDING NAME")):
        assert usage[command] == f"Usage: personaplex {command} [OPTIONS] {arguments}"


def test_help_reads_at_80_columns():
    """No default cut short ("nvidia/personaplex-7b-…") and no line broken mid-sentence
    where the docstring had its line break ("(add" then "--tail-silence")."""
    width = 80
    for words in _command_words():
        text = CliRunner().invoke(app, [*words, "-h"], env={"COLUMNS": str(width)}).stdout
        assert "…" not in text, (words, text)
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
        end = next((i for i, line in enumerate(lines) if line.startswith("╭")), len(lines))
        prose = [line.strip() for line in lines[start:end]]
        for line, following in zip(prose, prose[1:]):
            if line and following:  # a wrap inside a paragraph: the next word did not fit
                assert len(line) + 1 + len(following.split()[0]) > width - 4, (
                    words, line, following)


def _usage_error(args: list[str], capsys) -> tuple[int, list[str]]:
    """Runs the app in this process as main() does (the one error table): -> (exit
    status, stderr lines)."""
    import typer

    from personaplex_cli.cli import errors as cli_errors

    command = typer.main.get_command(app)
    code = cli_errors.run(lambda: command.main(args=args, prog_name="personaplex",
                                               standalone_mode=False))
    return code, capsys.readouterr().err.splitlines()


def test_what_usage_errors_say(capsys):
    # Named alone, a command says how it is called, not its whole help, after an error's
    # line as every other error (issue 30.15: it had none).
    assert _usage_error(["reply"], capsys) == (2, [
        "personaplex: error: missing arguments",
        "Usage: personaplex reply [OPTIONS] [IN... OUT]", "Try 'personaplex reply -h' for help."])
    # A mistyped option gets a likely meaning, an unknown one no unrelated suggestion.
    code, lines = _usage_error(["reply", "x", "y", "--bogus"], capsys)
    assert (code, lines[0]) == (2, "personaplex: error: No such option: --bogus")
    code, lines = _usage_error(["reply", "x", "y", "--temprature", "1"], capsys)
    assert lines[0].endswith("(Possible options: --temperature)"), lines
    code, lines = _usage_error(["reply", "x", "y", "--codes", "c.mimi"], capsys)
    assert lines[0].endswith("(Possible options: --codes-out)"), lines
    code, lines = _usage_error(["voices", "create", "r.wav"], capsys)
    assert lines[0] == "personaplex: error: Missing argument 'NAME'.", lines


def test_help_shows_no_value_on_flags():
    for command in (["encode"], ["decode"], ["reply"]):
        text = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).stdout
        for flag in ("--force", "--quiet", "--verbose", "--help"):
            line = next(line for line in text.splitlines() if flag in line)
            assert "<" not in line, line
    text = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout
    assert "<bool>" not in text


def test_each_verbosity_level_says_more(cli, speech_wav, tmp_path):
    said = [cli("encode", speech_wav, "-o", tmp_path / f"x{n}.mimi", *flags).stderr
            for n, flags in enumerate([[], ["-v"], ["-vv"]])]
    assert said[0] == b""
    assert len(said[1].splitlines()) >= 3 and said[1] in said[2]
    assert len(said[2].splitlines()) > len(said[1].splitlines())


def test_decode_follows_the_output_suffix(tmp_path, cli, encoded):
    for name, fmt in (("y.flac", "FLAC"), ("y.ogg", "OGG"), ("y.wav", "WAV")):
        assert_ok(cli("decode", encoded, "-o", tmp_path / name))
        info = sf.info(tmp_path / name)
        assert info.format == fmt and info.samplerate == SAMPLE_RATE
        if fmt != "OGG":
            assert info.frames == N_SAMPLES
    assert_ok(cli("decode", encoded, "-o", tmp_path / "y.raw"))
    assert (tmp_path / "y.raw").stat().st_size == 2 * N_SAMPLES
    assert_ok(cli("decode", encoded, "--format", "flac", "-o", tmp_path / "y.bin"))
    assert sf.info(tmp_path / "y.bin").format == "FLAC"
    for bad in (["--raw", "-o", tmp_path / "t.wav"], ["--format", "wav", "-o", tmp_path / "t.flac"],
                ["--sample-format", "f32", "-o", tmp_path / "t.flac"]):
        proc = cli("decode", encoded, *bad)
        assert proc.returncode == errors.EXIT_USAGE, proc.stderr.decode()
        assert proc.stderr.startswith(b"personaplex: error: ")
    assert not any(p.name.startswith("t.") for p in tmp_path.iterdir())


def test_model_missing_messages(tmp_path, cli, speech_wav, tiny_model_dir):
    proc = cli("encode", speech_wav, "-o", tmp_path / "x.mimi", env={"PERSONAPLEX_MODEL": None})
    assert_clean_error(proc, errors.EXIT_MODEL_MISSING)
    assert b"personaplex download" in proc.stderr and b"tokenizer-*.safetensors" in proc.stderr
    checkpoint = next(tiny_model_dir.glob("tokenizer-*.safetensors"))
    proc = cli("encode", speech_wav, "-o", tmp_path / "x.mimi", "--model", checkpoint)
    assert_clean_error(proc, errors.EXIT_MODEL_MISSING)
    assert b"expects a model directory" in proc.stderr
    # A folder holding just the Mimi file is enough for encode.
    only = tmp_path / "mimi-only"
    only.mkdir()
    shutil.copy(checkpoint, only)
    shutil.copy(tiny_model_dir / "personaplex-arch.json", only)
    assert_ok(cli("encode", speech_wav, "-o", tmp_path / "x.mimi", "--model", only))


def test_long_paths_are_not_wrapped_when_stderr_is_not_a_terminal(tmp_path, cli, speech_wav,
                                                                   tiny_model_dir):
    deep = tmp_path / ("a-rather-long-folder-name-" * 4) / "and-another-one-to-pass-80-columns"
    deep.parent.mkdir(parents=True)
    deep.symlink_to(tiny_model_dir)
    proc = cli("encode", speech_wav, "-o", tmp_path / "x.mimi", "-v", "--model", deep)
    assert_ok(proc)
    assert f"model: {deep}\n".encode() in proc.stderr
    proc = cli("encode", speech_wav, "-o", tmp_path / "x.mimi", "--model", deep)
    assert_clean_error(proc, errors.EXIT_OUTPUT)  # exists: one line, naming the whole path
    assert str(tmp_path / "x.mimi").encode() in proc.stderr


def test_truncated_code_file_error_names_it(tmp_path, cli, encoded):
    cut = tmp_path / "cut.mimi"
    cut.write_bytes(encoded.read_bytes()[:-5])
    proc = cli("decode", cut, "-o", tmp_path / "y.wav")
    assert_clean_error(proc, errors.EXIT_BAD_INPUT)
    assert proc.stderr.startswith(f"personaplex: error: {cut}: ".encode())


def encode_once_it_writes(folder: Path, env: dict, seconds: int) -> subprocess.Popen:
    """`encode long.wav -o x.mimi` of `seconds` of audio in `folder`, started and returned
    the moment its partial output appears (it opens its output before importing torch)."""
    long_wav = folder / "long.wav"
    write_wav_in_blocks(long_wav, seconds)
    proc = subprocess.Popen([sys.executable, "-m", "personaplex_cli", "encode", long_wav,
                             "-o", folder / "x.mimi"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(folder.glob(".x.mimi.*.part")):
        time.sleep(0.01)
    assert list(folder.glob(".x.mimi.*.part")), "encode never started writing"
    return proc


def test_two_quick_ctrl_c_exit_quietly(tmp_path, cli_env, model_env):
    proc = encode_once_it_writes(tmp_path, {**cli_env, **model_env}, 120)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr and b"Exception ignored" not in stderr, stderr.decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.wav"]


_CTRL_C_IN_TORCHS_IMPORT = """
import os, signal, sys, threading
from personaplex_cli.cli import errors
errors.install_signal_handlers()
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
import torch  # takes over a second: the signal comes in the middle of it
print("the import went on after Ctrl-C", file=sys.stderr)
"""


def test_ctrl_c_while_torch_is_imported_is_a_plain_interrupt(cli_env, tmp_path, model_env):
    """Raised in torch's import, the interrupt crossed its C++ and ended the process in
    std::terminate (SIGABRT and a C++ trace): it is held until the import ends, then said
    in one line, exit 130, and encode's partial output is gone."""
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_TORCHS_IMPORT], env=cli_env,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (130, b"personaplex: error: interrupted\n")

    proc = encode_once_it_writes(tmp_path, {**cli_env, **model_env}, 20)
    os.kill(proc.pid, signal.SIGINT)  # most likely still in torch's import
    _, stderr = proc.communicate(timeout=30)
    assert (proc.returncode, stderr) == (130, b"personaplex: error: interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.wav"]


def test_serve_help_names_every_route(tmp_path, monkeypatch):
    """serve -h names the OpenAI routes and what /api/reply takes (it named neither), and
    an error names a path without its `x/..` (issue 30.15)."""
    from personaplex_cli.errors import InputError
    from personaplex_cli.outputs import check_input

    text = " ".join(CliRunner().invoke(app, ["serve", "-h"], env={"COLUMNS": "200"})
                    .stdout.split())
    for route in ("/v1/realtime", "/v1/chat/completions", "/v1/models", "/api/chat",
                  "POST /api/reply answers a recording in its body", "tail_silence"):
        assert route in text, route
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as caught:
        check_input("man/../in/./missing.wav")
    assert caught.value.message == "in/missing.wav: no such file"
