"""`personaplex voices list|show|create` on the golden tiny checkpoints, as a user runs them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from personaplex_cli import errors
from personaplex_cli.prompts.voice import load_voice_pt

ASSETS = Path(__file__).parent / "data" / "golden" / "assets"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("voices-model") / "model"
    root.mkdir()
    for file in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                 "tokenizer_spm_tiny_512.model", "personaplex-arch.json"):
        (root / file).symlink_to(ASSETS / file)
    (root / "voices").mkdir()
    shutil.copy(ASSETS / "voice_prompt_bf16.pt", root / "voices" / "NATF2.pt")
    return root


@pytest.fixture
def voices(run_cli, model, tmp_path):
    own = tmp_path / "my-voices"

    def run(*args, **kwargs):
        env = {"PERSONAPLEX_MODEL": model, "PERSONAPLEX_DEVICE": "cpu",
               "PERSONAPLEX_VOICES_DIR": own, **kwargs.pop("env", {})}
        return run_cli("voices", *args, env=env, **kwargs)

    run.own = own
    run.run_cli = run_cli
    return run


def ok(proc):
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr
    return proc


def test_create_equals_nvidias_own_voice_files(voices):
    """From the golden voice recording: NVIDIA's .pt, cache exact, embeddings within 1e-5;
    bf16 by default (the released model's precision), fp32 on request."""
    for dtype, golden in ((None, "voice_prompt_bf16.pt"), ("fp32", "voice_prompt_fp32.pt")):
        name = f"mine-{dtype or 'default'}"
        args = ["create", ASSETS / "voice_prompt.wav", name] + (["--dtype", dtype] if dtype else [])
        proc = ok(voices(*args))
        path = Path(proc.stdout.decode().strip().splitlines()[-1])
        assert path == voices.own / f"{name}.pt"
        assert b"speaker agreed" in proc.stderr
        # 2.3 s of speech: taken, with the advice (issue 13.10)
        assert b"voice_prompt.wav is only 2.3 s long; 10 to 20 s of clear speech" in proc.stderr
        ours, want = load_voice_pt(path), load_voice_pt(ASSETS / golden)
        assert ours.embeddings.dtype == want.embeddings.dtype
        assert torch.equal(ours.cache, want.cache)
        assert (ours.embeddings.float() - want.embeddings.float()).abs().max() <= 1e-5
        # NVIDIA's loader is a plain torch.load of a dict with these two tensors.
        raw = torch.load(path, weights_only=True)
        assert set(raw) == {"embeddings", "cache"}


def test_list_and_show(voices):
    ok(voices("create", ASSETS / "voice_prompt.wav", "Robin", "--dtype", "fp32"))
    listing = json.loads(ok(voices("list", "--json")).stdout)
    rows = {row["name"]: row for row in listing["voices"]}
    assert len([r for r in rows.values() if r["origin"] == "packaged"]) == 18
    assert rows["NATF2"]["available"] and rows["NATF2"]["description"] == "natural female voice 2"
    assert not rows["VARM4"]["available"]
    assert rows["Robin"]["origin"] == "user" and rows["Robin"]["available"]
    text = ok(voices("list")).stdout.decode()
    assert "Robin" in text and "not downloaded" in text

    shown = json.loads(ok(voices("show", "NATF2", "--json")).stdout)
    assert shown["origin"] == "packaged" and shown["seconds"] == pytest.approx(29 * 0.08)
    assert shown["path"].endswith("voices/NATF2.pt")
    shown = json.loads(ok(voices("show", "Robin", "--json")).stdout)
    assert shown["origin"] == "user" and shown["seconds"] == pytest.approx(29 * 0.08)
    assert "seconds:" in ok(voices("show", "Robin")).stdout.decode()


def test_a_created_voice_speaks_in_reply(voices, run_cli, model, tmp_path):
    ok(voices("create", ASSETS / "voice_prompt.wav", "Robin", "--dtype", "fp32"))
    env = {"PERSONAPLEX_MODEL": model, "PERSONAPLEX_DEVICE": "cpu",
           "PERSONAPLEX_VOICES_DIR": voices.own}
    outputs = []
    for voice in ("Robin", str(ASSETS / "voice_prompt_fp32.pt")):
        out = tmp_path / f"{len(outputs)}.npy"
        ok(run_cli("reply", ASSETS / "input.wav", tmp_path / "a.wav", "-f", "--greedy",
                   "--voice", voice, "--codes-out", out, env=env))
        outputs.append(np.load(out))
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("case", ["too-short", "silent", "unreadable", "bad-name", "exists"])
def test_create_refuses(case, voices, tmp_path):
    recording = tmp_path / "r.wav"
    name, code = "v1", errors.EXIT_BAD_INPUT
    if case == "too-short":
        sf.write(recording, 0.3 * np.sin(np.arange(12000) / 10), 24000)
    elif case == "silent":
        sf.write(recording, np.zeros(72000), 24000)
    elif case == "unreadable":
        recording.write_text("not audio at all\n" * 50)
    elif case == "bad-name":
        shutil.copy(ASSETS / "voice_prompt.wav", recording)
        name = "../escape"
    elif case == "exists":
        shutil.copy(ASSETS / "voice_prompt.wav", recording)
        voices.own.mkdir()
        (voices.own / "v1.pt").write_bytes(b"keep")
        code = errors.EXIT_OUTPUT
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    proc = voices("create", recording, name)
    stderr = proc.stderr.decode()
    assert proc.returncode == code, stderr
    assert stderr.startswith("personaplex: error: ") and len(stderr.strip().splitlines()) == 1
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    if case == "exists":
        assert (voices.own / "v1.pt").read_bytes() == b"keep"


def test_a_packaged_name_is_refused_unless_forced(voices, tmp_path):
    """Issue 13.10: `create rec.wav NATF2` would hide the packaged NATF2; with --force it
    does, and list and show say that the voice is the user's own. A recording without
    speech is accepted, with a warning."""
    rng = np.random.default_rng(0)
    hiss = tmp_path / "hiss.wav"  # 6 s of room noise, not a word in it
    sf.write(hiss, 0.001 * rng.standard_normal(6 * 24000), 24000)
    proc = voices("create", hiss, "natf2")  # in any case (test_errors has VARF1 as is)
    assert proc.returncode == errors.EXIT_OUTPUT, proc.stderr.decode()
    assert "natf2 is the name of a packaged voice, NATF2" in proc.stderr.decode()
    assert "--force" in proc.stderr.decode()
    assert not voices.own.exists()

    proc = ok(voices("create", hiss, "NATF2", "--force"))
    stderr = proc.stderr.decode()
    assert "hiss.wav is mostly silence or noise" in stderr
    assert "10 to 20 s of clear speech" in stderr
    assert "now stands in for the packaged voice NATF2" in stderr
    assert (voices.own / "NATF2.pt").is_file()

    line = next(line for line in ok(voices("list")).stdout.decode().splitlines()
                if line.startswith("NATF2"))
    assert line.split()[1] == "user" and "natural female" not in line
    assert "your own voice, over the packaged one" in line
    shown = json.loads(ok(voices("show", "NATF2", "--json")).stdout)
    assert shown["origin"] == "user"
    assert shown["description"] == "your own voice, over the packaged one"


def test_a_packaged_voice_that_is_not_here_is_missing_not_unknown(voices, model, tmp_path):
    """Issue 13.10 and 13.11: list marks NATM1 "not downloaded"; show says the same, how to
    get it, and exits 3 (the model is not on this machine), as reply does."""
    listing = ok(voices("list"))
    assert re.search(r"^NATM1 .* not downloaded$", listing.stdout.decode(), re.M)
    hint = f"copy voices/ or voices.tgz of nvidia/personaplex-7b-v1 into {model}"
    assert f"17 of the 18 packaged voices are not on this machine: {hint}" in \
        listing.stderr.decode()
    for name in ("NATM1", "natm1"):
        proc = voices("show", name)
        stderr = proc.stderr.decode()
        assert proc.returncode == errors.EXIT_MODEL_MISSING, stderr
        assert "voice NATM1 is one of the packaged voices, but it is not on this machine" in stderr
        assert hint in stderr
    proc = voices("show", "NOBODY")  # a name no one knows stays a bad input
    assert proc.returncode == errors.EXIT_BAD_INPUT and b"unknown voice" in proc.stderr

    # No model at all: the hub model is not in the (empty) cache.
    env = {"PERSONAPLEX_MODEL": None}
    listing = ok(voices("list", env=env))
    assert "not downloaded: run `personaplex download`" in listing.stderr.decode()
    proc = voices("show", "NATF2", env=env)
    assert proc.returncode == errors.EXIT_MODEL_MISSING, proc.stderr.decode()
    assert "nvidia/personaplex-7b-v1 is not downloaded: run `personaplex download`" in \
        proc.stderr.decode()

    # reply says the same, with exit 3.
    proc = voices.run_cli("reply", ASSETS / "input.wav", tmp_path / "a.wav", "--voice", "NATM1",
                          "-p", "Hi.", env={"PERSONAPLEX_MODEL": model,
                                            "PERSONAPLEX_DEVICE": "cpu"})
    assert proc.returncode == errors.EXIT_MODEL_MISSING, proc.stderr.decode()
    assert b"voice NATM1 is one of the packaged voices" in proc.stderr
    assert not (tmp_path / "a.wav").exists()


@pytest.mark.parametrize("sound,speech", [
    ("speech", (11.0, 12.0)), ("speech in noise", (10.0, 12.0)), ("white noise", (0, 0.1)),
    ("loud hum", (0, 0.1)), ("a tone", (0, 0.1)), ("a click in silence", (0, 0.5)),
    ("speech after silence", (3.5, 4.5))])
def test_speech_seconds(sound, speech):
    from conftest import speech_like
    from personaplex_cli.prompts.voice import normalize_loudness, speech_seconds

    rng = np.random.default_rng(1)
    n = 12 * 24000
    t = np.arange(n) / 24000
    pcm = {
        "speech": lambda: speech_like(12),
        # speech 10 dB above white noise (its RMS to the noise's)
        "speech in noise": lambda: speech_like(12) + 0.05 * rng.standard_normal(n),
        "white noise": lambda: 0.001 * rng.standard_normal(n),
        "loud hum": lambda: 0.5 * np.sin(2 * np.pi * 50 * t) + 0.2 * np.sin(2 * np.pi * 100 * t),
        "a tone": lambda: 0.3 * np.sin(2 * np.pi * 440 * t),
        "a click in silence": lambda: np.r_[np.zeros(n // 2), 0.5 * rng.standard_normal(2000),
                                            np.zeros(n - n // 2 - 2000)],
        "speech after silence": lambda: np.r_[1e-4 * rng.standard_normal(8 * 24000),
                                              speech_like(4)],
    }[sound]()
    seconds = speech_seconds(normalize_loudness(pcm, 24000), 24000)
    assert speech[0] <= seconds <= speech[1], seconds


def test_a_voice_named_as_nvidias_client_names_it(tmp_path, monkeypatch):
    """`--voice NATF2.pt` with no such file here is the voice NATF2, as serve takes
    `voice_prompt=NATF2.pt` (it was "voice file NATF2.pt does not exist"); a file of that
    name, when there is one, is still the file (issue 30.15)."""
    from conftest import golden_model_folder

    from personaplex_cli.prompts.voices import VoiceNotFoundError, find_voice

    folder = golden_model_folder(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    voice = find_voice("NATF2.pt", folder / "voices")
    assert voice.name == "NATF2" and voice.origin != "file"
    with pytest.raises(VoiceNotFoundError, match="voice file NOPE.pt does not exist"):
        find_voice("NOPE.pt", folder / "voices")
    shutil.copy(folder / "voices" / "NATF2.pt", tmp_path / "NATF2.pt")
    assert find_voice("NATF2.pt", folder / "voices").origin == "file"
