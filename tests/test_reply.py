"""`personaplex reply` as a user runs it: real subprocesses on the golden tiny checkpoints.

The command-line parity test runs every fp32 greedy golden case through the console script
(NVIDIA's own outputs are the oracle) and requires the golden tokens (via --codes-out), text
pieces (via --text-out x.json) and PCM within 1e-4 (via --sample-format f32).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import golden_model_folder as model_folder, speech_like
from personaplex_cli import errors

GOLDEN = Path(__file__).parent / "data" / "golden"
ASSETS = GOLDEN / "assets"
FRAME = 1920


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("golden-models")
    return {"small": model_folder(base / "small"),
            "big": model_folder(base / "big", "personaplex-arch-bigctx.json")}


@pytest.fixture(scope="module")
def reply(run_cli, models, tmp_path_factory):
    voices = tmp_path_factory.mktemp("user-voices")

    def run(*args, model="small", env=None, **kwargs):
        full_env = {"PERSONAPLEX_MODEL": models[model], "PERSONAPLEX_DEVICE": "cpu",
                    "PERSONAPLEX_VOICES_DIR": voices, **(env or {})}
        return run_cli("reply", *args, env=full_env, **kwargs)

    return run


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr


def assert_clean_error(proc, code):
    stderr = proc.stderr.decode()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert lines and lines[0].startswith("personaplex: error:"), stderr
    assert len(lines) <= 2, stderr  # the message, and at most a usage hint


VOICES = {"wav": str(ASSETS / "voice_prompt.wav"), "pt": str(ASSETS / "voice_prompt_fp32.pt"),
          "none": ""}


@pytest.mark.parametrize("case", ["fp32_wav_greedy", "fp32_pt_greedy", "fp32_none_greedy",
                                  "fp32_wav_greedy_bigctx"])
def test_command_line_parity_with_nvidia(case, reply, tmp_path):
    voice = VOICES[case.split("_")[1]]
    out, text, codes = tmp_path / "out.wav", tmp_path / "text.json", tmp_path / "codes.npy"
    proc = reply(ASSETS / "input.wav", out, "--voice", voice, "--greedy", "--dtype", "fp32",
                 "--sample-format", "f32", "--text-out", text, "--codes-out", codes,
                 model="big" if case.endswith("bigctx") else "small")
    assert_ok(proc)
    tokens = np.load(GOLDEN / case / "tokens.npy")
    np.testing.assert_array_equal(np.load(codes), tokens[1:9])
    assert json.loads(text.read_text()) == json.loads((GOLDEN / case / "text_pieces.json")
                                                      .read_text())
    pcm, rate = sf.read(out, dtype="float32")
    want = np.load(GOLDEN / case / "output_pcm.npy")
    assert rate == 24000 and pcm.shape == want.shape
    assert np.abs(pcm - want).max() <= 1e-4


def _speech(path: Path, seconds: float, rate: int = 24000, channels: int = 1, seed: int = 0):
    mono = speech_like(seconds, rate, seed)
    data = mono if channels == 1 else np.stack([mono] * channels, axis=1) * 0.9
    sf.write(path, data, rate, subtype="PCM_16")
    return path


def test_reply_is_as_long_as_the_input_at_any_rate(reply, tmp_path):
    stereo = _speech(tmp_path / "q.wav", 1.3, rate=44100, channels=2)
    out = tmp_path / "a.wav"
    assert_ok(reply(stereo, out, "--seed", "3"))
    info = sf.info(out)
    want = round(sf.info(stereo).frames * 24000 / 44100)
    assert (info.samplerate, info.channels, info.frames) == (24000, 1, want)

    tail = tmp_path / "tail.wav"
    assert_ok(reply(stereo, tail, "--seed", "3", "--tail-silence", "0.5", "--rate", "16000"))
    info = sf.info(tail)
    assert info.samplerate == 16000
    assert info.frames == round((want + 12000) * 16000 / 24000)


def test_text_forms(reply, tmp_path):
    question = _speech(tmp_path / "q.wav", 2.0)
    outputs = {}
    for suffix in ("json", "txt", "srt", "vtt"):
        text = tmp_path / f"t.{suffix}"
        assert_ok(reply(question, tmp_path / f"a-{suffix}.wav", "--seed", "5", "--text-out", text))
        outputs[suffix] = text.read_text()
    pieces = json.loads(outputs["json"])
    assert len(pieces) == 25  # one per 80 ms frame of the 2 s input
    said = "".join(p for p in pieces if p not in ("PAD", "EPAD"))
    assert outputs["txt"] == said.lstrip() + "\n"
    assert "PAD" not in outputs["txt"].replace(said.lstrip(), "")
    assert outputs["vtt"].startswith("WEBVTT\n\n")
    srt_cues = outputs["srt"].strip().split("\n\n")
    assert srt_cues[0].startswith("1\n00:00:")
    assert " --> " in srt_cues[0] and "," in srt_cues[0].splitlines()[1]
    assert "".join(c.split("\n", 2)[2] for c in srt_cues).replace(" ", "") in \
        said.replace(" ", "")


def test_codes_out_decode_back_to_the_reply(reply, run_cli, models, tmp_path):
    """`reply --codes-out x.mimi` then `decode x.mimi` gives the reply back (issue 13): the
    header records NVIDIA's window rule, which the conversation decoded under. Kyutai's
    rule, decode's own, parts from it once the tiny Mimi's window fills (frame 19)."""
    question = _speech(tmp_path / "q.wav", 4.0)
    answer, codes = tmp_path / "a.wav", tmp_path / "a.mimi"
    assert_ok(reply(question, answer, "--seed", "4", "--sample-format", "f32",
                    "--codes-out", codes, "-p", "Answer briefly."))
    env = {"PERSONAPLEX_MODEL": models["small"], "PERSONAPLEX_DEVICE": "cpu"}
    decoded = {}
    for window in (None, "kyutai"):
        out = tmp_path / f"decoded-{window}.wav"
        extra = [] if window is None else ["--window", window]
        assert_ok(run_cli("decode", codes, "-o", out, "--sample-format", "f32", *extra,
                          env=env))
        decoded[window], _ = sf.read(out, dtype="float32")
    want, _ = sf.read(answer, dtype="float32")
    assert decoded[None].shape == want.shape == (4 * 24000,)
    assert np.abs(decoded[None] - want).max() <= 1e-4
    per_frame = np.abs(decoded["kyutai"] - want)[:len(want) // FRAME * FRAME]
    per_frame = per_frame.reshape(-1, FRAME).max(axis=1)
    assert per_frame[:19].max() <= 1e-4 and per_frame[20:].max() > 1e-3
    # A .npy records no window: decode says which rule it takes, and which reply's want
    # (issue 30.13: they decoded otherwise, silently).
    assert_ok(reply(question, tmp_path / "b.wav", "--seed", "4", "--codes-out",
                    tmp_path / "b.npy", "-p", "Answer briefly."))
    for extra, warned in (([], True), (["--window", "nvidia"], False)):
        proc = run_cli("decode", tmp_path / "b.npy", "-o", tmp_path / f"b{warned}.wav",
                       *extra, env=env)
        assert_ok(proc)
        assert ("codes from reply want --window nvidia" in proc.stderr.decode()) == warned


def test_pipes_and_exact_header(reply, tmp_path):
    question = _speech(tmp_path / "q.wav", 1.0)
    proc = reply("-", "-", "--seed", "1", input=question.read_bytes())
    assert_ok(proc)
    data = proc.stdout
    assert data[:4] == b"RIFF" and struct.unpack_from("<I", data, 40)[0] == 2 * 24000
    assert len(data) == 44 + 2 * 24000


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (.ci/run installs it: the README pipes through it)"
    return path


def test_the_readmes_sox_and_ffmpeg_pipes(reply, tmp_path):
    """`sox q.mp3 -t wav - | personaplex reply - -` (issue 13): sox declares the length it
    estimates for the MP3 (longer than what it sends), ffmpeg none; either way the reply is
    the one to the same conversion written to a file, with one warning for sox's guess."""
    mp3 = Path(__file__).parent / "data" / "audio" / "speech-22k-mono-cbr.mp3"
    sox, ffmpeg = _tool("sox"), _tool("ffmpeg")
    for name, to_pipe, to_file in (
            ("sox", [sox, mp3, "-t", "wav", "-"], [sox, mp3, tmp_path / "sox.wav"]),
            ("ffmpeg", [ffmpeg, "-nostdin", "-loglevel", "error", "-i", mp3, "-f", "wav", "-"],
             [ffmpeg, "-nostdin", "-loglevel", "error", "-i", mp3, tmp_path / "ffmpeg.wav"])):
        subprocess.run(to_file, check=True, capture_output=True)
        piped = subprocess.run(to_pipe, check=True, capture_output=True).stdout
        proc = reply("-", "-", "--seed", "2", "-p", "Answer briefly.", input=piped)
        assert_ok(proc)
        warnings = proc.stderr.decode().splitlines()
        assert len(warnings) == (1 if name == "sox" else 0), warnings
        assert all("its WAV header declares" in line for line in warnings)
        answer = tmp_path / f"{name}-answer.wav"
        assert_ok(reply(tmp_path / f"{name}.wav", answer, "--seed", "2", "-p",
                        "Answer briefly."))
        want = answer.read_bytes()[44:]
        # On a pipe the header cannot be corrected afterwards: the reply to sox's stream
        # declares sox's estimate and is padded with silence up to it, so that the header
        # stays true (a reader such as play then has nothing to warn about).
        declared = struct.unpack_from("<I", proc.stdout, 40)[0]
        if name == "sox":
            assert declared == len(proc.stdout) - 44 > len(want)
            assert not any(proc.stdout[44 + len(want):])
        else:
            assert declared == 0xFFFFFFFF  # ffmpeg declares no length: neither does the reply
        assert proc.stdout[44:44 + len(want)] == want
        assert len(want) == 2 * round(sf.info(tmp_path / f"{name}.wav").frames * 24000 / 22050)


def test_dev_stdout_onto_an_existing_file_needs_no_force(reply, tmp_path):
    """`reply q.wav /dev/stdout > answer.wav`: the shell made answer.wav, so /dev/stdout
    resolves to an existing regular file; like `-`, it is stdout, not a file to protect."""
    question = _speech(tmp_path / "q.wav", 1.0)
    answer = tmp_path / "answer.wav"
    with open(answer, "wb") as sink:
        proc = reply(question, "/dev/stdout", "--seed", "1", stdout=sink.fileno())
    assert_ok(proc)
    data = answer.read_bytes()
    assert data[:4] == b"RIFF" and len(data) == 44 + 2 * 24000


def test_batch_equals_one_at_a_time(reply, tmp_path):
    inputs = [_speech(tmp_path / f"in{i}.wav", s, seed=i) for i, s in enumerate((1.0, 1.6, 0.7))]
    solo = []
    for i, path in enumerate(inputs):
        (tmp_path / f"solo{i}").mkdir()
        assert_ok(reply(path, tmp_path / f"solo{i}", "--greedy", "--codes-out", "npy"))
        solo.append(np.load(tmp_path / f"solo{i}" / f"in{i}.npy"))
    together = tmp_path / "together"
    together.mkdir()
    assert_ok(reply(*inputs, together, "--greedy", "--codes-out", "npy", "--batch-size", "2"))
    for i, path in enumerate(inputs):
        np.testing.assert_array_equal(np.load(together / f"in{i}.npy"), solo[i])
        assert sf.info(together / f"in{i}.wav").frames == sf.info(path).frames
        # What the README says of the audio (issue 30.14): the codec decodes a batch's
        # rows together, so a sample may differ from the row alone by its last bit.
        batched, _ = sf.read(together / f"in{i}.wav", dtype="int16")
        alone, _ = sf.read(tmp_path / f"solo{i}" / f"in{i}.wav", dtype="int16")
        assert np.abs(batched.astype(int) - alone).max() <= 1


def test_sampled_streams_do_not_depend_on_their_batch_mates(reply, tmp_path):
    a, b, c = (_speech(tmp_path / f"{n}.wav", 1.2, seed=i) for i, n in enumerate("abc"))
    results = []
    for mate in (b, c):
        folder = tmp_path / f"with-{mate.stem}"
        folder.mkdir()
        assert_ok(reply(a, mate, folder, "--seed", "11", "--codes-out", "npy"))
        results.append(np.load(folder / "a.npy"))
    np.testing.assert_array_equal(results[0], results[1])
    # Sampling really is on: another seed says something else.
    other = tmp_path / "other"
    other.mkdir()
    assert_ok(reply(a, b, other, "--seed", "12", "--codes-out", "npy"))
    assert not np.array_equal(np.load(other / "a.npy"), results[0])


def test_longer_than_the_context(reply, tmp_path):
    """The tiny model's window is 64 frames; 20 s is 250 frames, so the window slides."""
    question = _speech(tmp_path / "long.wav", 20.0)
    out = tmp_path / "a.wav"
    assert_ok(reply(question, out, "--seed", "2", "--codes-out", tmp_path / "c.npy"))
    assert sf.info(out).frames == 20 * 24000
    assert np.load(tmp_path / "c.npy").shape == (8, 250)


def _pickle_bomb(path: Path) -> Path:
    """A .pt whose unpickling would run code (it would create `marker`)."""
    import pickle
    import zipfile

    marker = path.with_suffix(".ran")

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps({"embeddings": Evil(), "cache": Evil()}, protocol=2)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("evil/data.pkl", payload)
        archive.writestr("evil/version", "3\n")
    return path


@pytest.mark.parametrize("name", ["missing-input", "unknown-voice", "pickle-voice",
                                  "not-a-voice", "empty-prompt", "prompt-too-long",
                                  "prime-over-max", "several-without-dir", "missing-model",
                                  "exists"])
def test_failures(name, reply, tmp_path):
    question = _speech(tmp_path / "q.wav", 0.5)
    out = tmp_path / "out" / "a.wav"
    out.parent.mkdir()
    args, code, env = [question, out], errors.EXIT_BAD_INPUT, {}
    if name == "missing-input":
        args = [tmp_path / "nope.wav", out]
    elif name == "unknown-voice":
        args += ["--voice", "NOBODY"]
    elif name == "pickle-voice":
        args += ["--voice", _pickle_bomb(tmp_path / "evil.pt")]
    elif name == "not-a-voice":
        (tmp_path / "x.pt").write_bytes(b"not a torch file")
        args += ["--voice", tmp_path / "x.pt"]
    elif name == "empty-prompt":
        args += ["--prompt", "   "]
    elif name == "prompt-too-long":
        args += ["--prompt", "word " * 400]
    elif name == "prime-over-max":  # fits the context, not the priming time allowed
        args += ["--prompt", "Answer every question in French.", "--max-prime-s", "1e-6"]
    elif name == "several-without-dir":
        args, code = [question, question, out], errors.EXIT_OUTPUT
    elif name == "missing-model":
        code, env = errors.EXIT_MODEL_MISSING, {"PERSONAPLEX_MODEL": tmp_path / "no-model"}
    elif name == "exists":
        out.write_bytes(b"keep")
        code = errors.EXIT_OUTPUT
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = reply(*args, env=env)
    assert_clean_error(proc, code)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing left behind
    assert not (tmp_path / "evil.ran").exists()
    if name == "exists":
        assert out.read_bytes() == b"keep"
    if name == "prime-over-max":
        assert "--max-prime-s 1e-06 allows 0 tokens" in proc.stderr.decode()


def test_ctrl_c_leaves_no_partial_output(cli_env, models, tmp_path):
    import os
    import signal
    import time

    question = _speech(tmp_path / "q.wav", 60.0)
    env = {**cli_env, "PERSONAPLEX_MODEL": str(models["small"]), "PERSONAPLEX_DEVICE": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "personaplex_cli", "reply", question,
                             tmp_path / "a.wav", "--text-out", tmp_path / "a.srt", "-v"],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(tmp_path.glob(".a.wav.*.part")):
        time.sleep(0.1)
    assert list(tmp_path.glob(".a.wav.*.part")), "the reply never started writing"
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr
    assert stderr.decode().strip().splitlines()[-1] == "personaplex: error: interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.wav"]


def test_reply_runs_on_the_remembered_thread_count(reply, models, tmp_path, monkeypatch):
    """reply never times anything: it takes the count serve or talk measured on this
    machine (so a seeded run's bytes do not follow a timing), unless OMP_NUM_THREADS says."""
    from personaplex_cli.model.model import Model
    from personaplex_cli.runtime.warmup import Threads, ThreadsMemory

    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    ThreadsMemory.of_model(Model.open(str(models["small"]), "cpu", "fp32")).remember(
        Threads(1, {1: 8.0, 2: 230.0}))
    env = {"XDG_CACHE_HOME": cache, "OMP_NUM_THREADS": None, "MKL_NUM_THREADS": None}
    proc = reply(ASSETS / "input.wav", tmp_path / "out.wav", "--voice", "", "--greedy",
                 "--dtype", "fp32", "-v", env=env)
    assert_ok(proc)
    assert "1 torch thread (measured once on this machine)" in proc.stderr.decode()
    pinned = reply(ASSETS / "input.wav", tmp_path / "pinned.wav", "--voice", "", "--greedy",
                   "--dtype", "fp32", "-v", env={**env, "OMP_NUM_THREADS": "1"})
    assert_ok(pinned)
    assert "measured once" not in pinned.stderr.decode()
    # issue 30.8: -v says the count it runs on and where it came from, whatever that is
    assert "1 torch thread (OMP_NUM_THREADS as set)" in pinned.stderr.decode()
    fresh = reply(ASSETS / "input.wav", tmp_path / "fresh.wav", "--voice", "", "--greedy",
                  "--dtype", "fp32", "-v", env={**env, "XDG_CACHE_HOME": tmp_path / "none"})
    assert_ok(fresh)
    assert "(torch's default: not measured by serve or talk" in fresh.stderr.decode()


def test_reply_reports_the_runtimes_step_statistics(reply, tmp_path):
    """reply's last lines read the runtime's StepStats (serve's /metrics and talk's live
    line read the same object): steps, row-frames, step p50 and p99."""
    import re

    proc = reply(ASSETS / "input.wav", tmp_path / "out.wav", "--voice", "", "--greedy",
                 "--dtype", "fp32", "-v")
    assert_ok(proc)
    text = proc.stderr.decode()
    done = re.search(r"1 of 1 answered: (\d+) frames", text)
    steps = re.search(r"(\d+) steps of (\d+) row-frames: step p50 [\d.]+ ms, p99 [\d.]+ ms",
                      text)
    assert done and steps, text
    assert steps.group(1) == steps.group(2) == done.group(1)  # one row: a frame a step


ONE_STREAM_PEAK = r"""
import json, re, sys
from pathlib import Path

def status(field):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024

from personaplex_cli.cli.app import main
from personaplex_cli.model.model import Model

folder, given, answer = sys.argv[1:4]
need = Model.open(folder, "cpu", "fp32").preflight(1)
Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
base = status("VmRSS")
sys.argv = ["personaplex", "reply", "--model", folder, "--device", "cpu", "--dtype", "fp32",
            "--voice", "", "--greedy", given, answer]
try:
    main()
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "grew": status("VmHWM") - base, "window": need.kv_per_stream,
                  "tensors": need.total - need.margin,
                  "one_window": need.weights + need.kv_per_stream + need.mimi}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_one_stream_holds_one_window_and_peaks_at_its_count(tmp_path):
    """A reply of one stream primes in its own row: model/memory.py counts one KV window
    for it, and `reply` itself holds no more. The tiny model with a 300 000-frame window
    (0.29 GiB, far above all else it holds) shows it: the run's peak grows by the count's
    tensors, not by a second window (the primer's row before: 656 MiB against 311)."""
    folder = model_folder(tmp_path / "model")
    arch_file = folder / "personaplex-arch.json"
    arch = json.loads(arch_file.read_text())
    arch["lm"]["context"] = 300_000
    arch_file.write_text(json.dumps(arch))
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ONE_STREAM_PEAK, str(folder),
                           str(ASSETS / "input.wav"), str(tmp_path / "out.wav")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"grew {got['grew'] / 2**20:.0f} MiB against {got['tensors'] / 2**20:.0f} MiB of "
          f"tensors ({got['window'] / 2**20:.0f} MiB a window)")
    assert got["code"] in (0, None), got
    assert got["grew"] <= got["one_window"] + got["window"] / 2, got  # what reply holds
    assert got["tensors"] == got["one_window"], got  # and what the count says


def test_names_and_prompts_that_are_not_utf8(reply, run_cli, models, tmp_path):
    """A valid recording whose name is not UTF-8 (Latin-1's é) is read as any other, by
    reply (WAV, FLAC), encode and --voice (it was called corrupt: soundfile encoded the
    name strictly). A prompt that is not UTF-8, on the command line or in a manifest row,
    is refused in a line with exit 7 before the model loads (it was an internal error,
    exit 1, after loading)."""
    import os

    def latin1(name: str, make) -> Path:
        plain = make(tmp_path / f"plain-{name}")
        odd = tmp_path / name.replace("e", "\udce9", 1)  # the byte 0xe9 in the name
        os.rename(plain, os.fsencode(odd))
        return odd

    wav = latin1("cafe.wav", lambda p: _speech(p, 0.6, seed=3))
    flac = latin1("cafe.flac", lambda p: (sf.write(p, speech_like(0.6, seed=4), 24000), p)[1])
    for source, out in ((wav, "a.wav"), (flac, "b.wav")):
        assert_ok(reply(source, tmp_path / out, "--greedy"))
        assert sf.info(tmp_path / out).frames == int(0.6 * 24000)
    assert_ok(reply(tmp_path / "a.wav", tmp_path / "c.wav", "--greedy", "--voice", wav))
    encoded = run_cli("encode", wav, "-o", tmp_path / "a.mimi",
                      env={"PERSONAPLEX_MODEL": models["small"], "PERSONAPLEX_DEVICE": "cpu"})
    assert_ok(encoded)

    absent = {"PERSONAPLEX_MODEL": tmp_path / "no-model-here"}  # loading it would be exit 3
    proc = reply(wav, tmp_path / "d.wav", "--prompt", "caf\udce9", env=absent)
    assert_clean_error(proc, 7)
    assert "--prompt is not UTF-8 text: character 4 is the byte 0xe9" in proc.stderr.decode()
    manifest = tmp_path / "rows.jsonl"
    manifest.write_text(json.dumps({"input": "a.wav", "output": "e.wav",
                                    "prompt": "caf\udce9"}) + "\n")
    proc = reply("--manifest", manifest)
    assert_clean_error(proc, 7)
    assert "rows.jsonl:1: the prompt is not UTF-8 text" in proc.stderr.decode()


def test_decode_into_sox_on_a_pipe(run_cli, models, tmp_path):
    """`decode x.mimi -o - | sox - out.flac` (issue 30.12): sox took the WAV header, sent
    alone before the model had loaded, for the whole first read ("RIFF header not found",
    exit 141 upstream); the header now goes with the first samples."""
    question = _speech(tmp_path / "q.wav", 1.0)
    env = {"PERSONAPLEX_MODEL": models["small"], "PERSONAPLEX_DEVICE": "cpu"}
    assert_ok(run_cli("encode", question, "-o", tmp_path / "q.mimi", env=env))
    sox = subprocess.Popen([_tool("sox"), "-", tmp_path / "out.flac"], stdin=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    decoded = run_cli("decode", tmp_path / "q.mimi", "-o", "-", env=env,
                      stdout=sox.stdin.fileno())
    sox.stdin.close()
    assert sox.wait(60) == 0, sox.stderr.read().decode()
    assert_ok(decoded)
    assert sf.info(tmp_path / "out.flac").frames == 24000
