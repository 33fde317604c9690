"""Finding the model's files: a local directory, or a Hugging Face repo in the local hub cache.

A model directory holds the published file names:
  model.safetensors                              the language model
  tokenizer-e351c8d8-checkpoint125.safetensors   Mimi (any `tokenizer-*.safetensors`)
  tokenizer_spm_32k_3.model                      the text tokenizer (any `*.model`)
  voices/ or voices.tgz                          voice prompts
  personaplex-arch.json                          optional architecture overrides
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelMissingError

DEFAULT_MODEL = "nvidia/personaplex-7b-v1"
MIMI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"
LM_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer_spm_32k_3.model"
ARCH_FILE = "personaplex-arch.json"


class ModelNotFoundError(ModelMissingError):
    """The model, or one of its files, is not available on this machine."""


@dataclass
class ModelDir:
    path: Path
    name: str  # what the user asked for: a repo id or a directory

    def _pick(self, preferred: str, pattern: str, what: str) -> Path:
        exact = self.path / preferred
        if exact.is_file():
            return exact
        matches = sorted(p for p in self.path.glob(pattern) if p.is_file())
        if not matches:
            raise ModelNotFoundError(f"{what} ({preferred}) is missing from model {self.name}")
        if len(matches) > 1:
            names = ", ".join(p.name for p in matches)
            raise ModelNotFoundError(f"model {self.name} has several {what} files ({names})")
        return matches[0]

    def mimi_file(self) -> Path:
        return self._pick(MIMI_FILE, "tokenizer-*.safetensors", "the Mimi codec checkpoint")

    def lm_file(self) -> Path:
        return self._pick(LM_FILE, LM_FILE, "the language model checkpoint")

    def tokenizer_file(self) -> Path:
        return self._pick(TOKENIZER_FILE, "*.model", "the text tokenizer")

    def arch_file(self) -> Path | None:
        path = self.path / ARCH_FILE
        return path if path.is_file() else None


def resolve_model(spec: str | None) -> ModelDir:
    """A local directory as is; a repo id through the local hub cache only (no network)."""
    spec = spec or DEFAULT_MODEL
    local = Path(spec).expanduser()
    if local.is_dir():
        return ModelDir(local, spec)
    if spec.startswith((".", "/", "~")) or local.exists():
        raise ModelNotFoundError(f"model directory {spec} does not exist")
    if spec.count("/") != 1:
        raise ModelNotFoundError(
            f"model {spec!r} is neither a directory nor a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(spec, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise ModelNotFoundError(
            f"model {spec} is not in the local Hugging Face cache; download it first "
            "or pass --model DIR") from None
    except HFValidationError:
        raise ModelNotFoundError(f"{spec!r} is not a valid Hugging Face repo id") from None
    return ModelDir(Path(snapshot), spec)
