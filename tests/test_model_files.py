"""Model resolution and the cached identity of weight files."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from personaplex_cli.model.files import ModelNotFoundError, resolve_model
from personaplex_cli.model.load import weights_sha256


def test_sha256_is_computed_once_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = tmp_path / "tokenizer-x.safetensors"
    weights.write_bytes(b"weights" * 1000)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert weights_sha256(weights) == digest
    index_path = tmp_path / "cache" / "personaplex" / "sha256.json"
    index = json.loads(index_path.read_text())
    assert list(index.values()) == [digest]
    # The second call reads the remembered value instead of hashing again.
    index_path.write_text(json.dumps({key: "f" * 64 for key in index}))
    assert weights_sha256(weights) == "f" * 64
    # A changed file (size or mtime) is hashed afresh.
    weights.write_bytes(b"other weights")
    os.utime(weights, ns=(1, 1))
    assert weights_sha256(weights) == hashlib.sha256(b"other weights").hexdigest()


def test_hub_cache_blobs_are_named_by_their_sha256(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    blob = tmp_path / "blobs" / ("a" * 64)
    blob.parent.mkdir()
    blob.write_bytes(b"not hashed")
    link = tmp_path / "model.safetensors"
    link.symlink_to(blob)
    assert weights_sha256(link) == "a" * 64


def test_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model(str(tmp_path)).path == tmp_path
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="local Hugging Face cache"):
        resolve_model("nvidia/personaplex-7b-v1")
    with pytest.raises(ModelNotFoundError, match="neither a directory nor"):
        resolve_model("not-a-repo-id")
    with pytest.raises(ModelNotFoundError, match="Mimi"):
        resolve_model(str(tmp_path)).mimi_file()
