"""`personaplex download --tiny`: a tiny random-weight model in the hub's layout, written in
seconds without a network, that every command runs on (the README's examples run on it too:
tests/test_readme.py)."""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path

import pytest

from personaplex_cli import errors
from personaplex_cli.model.files import (ARCH_FILE, HUB_FILES, LM_FILE, TINY_DIR, VOICES_DIR,
                                         random_weights_seed)
from personaplex_cli.model.voices_archive import STAMP_NAME
from personaplex_cli.model.files import PACKAGED


def error_lines(proc) -> list[str]:
    return proc.stderr.decode().splitlines()


def digests(folder: Path) -> dict[str, str]:
    """Every file's sha256 but the voices' extraction stamp (it records the archive's time)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != STAMP_NAME}


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "xdg-cache"


def test_it_writes_the_hubs_files_says_once_that_it_speaks_noise_and_again_the_same(
        run_cli, cache):
    proc = run_cli("download", "--tiny", env={"XDG_CACHE_HOME": cache})
    assert proc.returncode == 0, proc.stderr
    folder = cache / "personaplex" / TINY_DIR
    assert proc.stdout.decode().splitlines()[-1] == str(folder)
    note = error_lines(proc)
    assert len(note) == 1 and "noise" in note[0] and "random weights" in note[0], note
    assert f"--model {folder}" in note[0] and "PERSONAPLEX_MODEL" in note[0]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*HUB_FILES, ARCH_FILE,
                                                               VOICES_DIR])
    assert sorted(p.stem for p in (folder / VOICES_DIR).glob("*.pt")) == sorted(PACKAGED)
    assert random_weights_seed(folder / LM_FILE) == 0
    assert sorted(p.name for p in folder.parent.iterdir()) == [TINY_DIR]  # no leftovers
    first = digests(folder)

    again = run_cli("download", "--tiny", "--json", "-q", env={"XDG_CACHE_HOME": cache})
    assert again.returncode == 0 and again.stderr == b"", again.stderr
    result = json.loads(again.stdout)
    assert (result["path"], result["tiny"], result["repo"]) == (str(folder), True, None)
    assert {f["name"] for f in result["files"]} == {*HUB_FILES, ARCH_FILE}
    assert digests(folder) == first  # seeded: the same bytes every time


def test_its_voices_are_in_nvidias_layout_and_its_lm_in_the_published_one(tmp_path):
    import torch

    from personaplex_cli.model.random_model import write_tiny_model
    from personaplex_cli.model.tensorfile import read_header

    model = write_tiny_model(tmp_path / "tiny")
    voice = torch.load(model.path / VOICES_DIR / "NATF2.pt", map_location="cpu",
                       weights_only=True)
    assert voice["embeddings"].shape == (16, 1, 1, 64)  # a quarter of its 64-frame window
    assert voice["embeddings"].dtype == torch.bfloat16
    assert voice["cache"].shape == (1, 17, 4) and voice["cache"].dtype == torch.int64
    keys = read_header(model.path / LM_FILE)
    # The depformer's 16 steps fused in one tensor, as NVIDIA's file holds them.
    fused = [k for k in keys if k.endswith("self_attn.in_proj_weight")
             and k.startswith("depformer")]
    assert fused and keys[fused[0]].shape[0] == 16 * 3 * 32


def test_every_command_takes_it_through_personaplex_model(run_cli, cache, speech_wav,
                                                          tmp_path):
    """reply and voices at their defaults (NATF2, NVIDIA's role prompt), encode and decode,
    and doctor, which says what the model is and passes."""
    folder = Path(run_cli("download", "--tiny", "-q", env={"XDG_CACHE_HOME": cache})
                  .stdout.decode().strip())
    env = {"XDG_CACHE_HOME": cache, "PERSONAPLEX_MODEL": folder}
    proc = run_cli("reply", speech_wav, tmp_path / "answer.wav", "--text-out",
                   tmp_path / "answer.txt", env=env)
    assert proc.returncode == 0, proc.stderr
    import soundfile

    assert soundfile.info(tmp_path / "answer.wav").frames == soundfile.info(speech_wav).frames
    listed = run_cli("voices", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    voices = json.loads(listed.stdout)["voices"]
    assert sorted(v["name"] for v in voices if v["available"]) == sorted(PACKAGED)
    proc = run_cli("encode", speech_wav, "-o", tmp_path / "x.mimi", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("decode", tmp_path / "x.mimi", "-o", tmp_path / "x.wav", env=env)
    assert proc.returncode == 0, proc.stderr
    doctor = run_cli("doctor", "--json", env=env)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    model = checks["model"]
    assert model["status"] == "warn", model
    assert "tiny model with random weights" in model["detail"] and "noise" in model["detail"]
    assert "personaplex download" in model["fix"]
    assert doctor.returncode == 0 or any(c["status"] == "fail" and c["name"] != "model"
                                         for c in checks.values()), checks


@pytest.mark.parametrize("args", [["--revision", "main"], ["--token", "hf_x"], ["--verify"],
                                  ["--model", "nvidia/personaplex-7b-v1"]])
def test_hub_options_with_tiny_are_bad_usage(run_cli, cache, args):
    proc = run_cli("download", "--tiny", *args, env={"XDG_CACHE_HOME": cache})
    assert proc.returncode == errors.EXIT_USAGE
    lines = error_lines(proc)
    assert len(lines) == 2 and args[0] in lines[0] and "--tiny" in lines[0], lines
    assert not cache.exists()


def test_download_after_exporting_the_tiny_folder_says_to_unset_it(run_cli, cache, tmp_path):
    """As after `export PERSONAPLEX_MODEL=$(personaplex download --tiny)`: download's
    default repo came from the variable, and the message names it."""
    proc = run_cli("download", env={"XDG_CACHE_HOME": cache, "PERSONAPLEX_MODEL": tmp_path})
    assert proc.returncode == errors.EXIT_USAGE
    line = error_lines(proc)[0]
    assert "unset PERSONAPLEX_MODEL" in line and "(from PERSONAPLEX_MODEL)" in line, line


def test_a_folder_of_other_files_is_left_alone(run_cli, cache):
    folder = cache / "personaplex" / TINY_DIR
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine\n")
    proc = run_cli("download", "--tiny", env={"XDG_CACHE_HOME": cache})
    assert proc.returncode == errors.EXIT_OUTPUT
    lines = error_lines(proc)
    assert len(lines) == 1 and "move them away" in lines[0] and "Traceback" not in lines[0]
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert [p.name for p in folder.parent.iterdir()] == [TINY_DIR]


def test_a_write_that_fails_leaves_the_model_that_was_there(tmp_path, monkeypatch):
    from personaplex_cli.model import random_model

    target = tmp_path / "tiny"
    random_model.write_tiny_model(target)
    before = digests(target)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(random_model, "write_lm", full_disk)
    with pytest.raises(errors.DiskFullError, match="no space left"):
        random_model.write_tiny_model(target)
    assert digests(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temporary folder
    monkeypatch.undo()
    (target / "notes.txt").write_text("not ours\n")
    random_model.write_tiny_model(target)  # a tiny model with more in it is still ours
    assert not (target / "notes.txt").exists()
