"""`personaplex voices list|show|create` on the golden tiny checkpoints, as a user runs them."""

from __future__ import annotations

import json
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
