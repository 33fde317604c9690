"""Finding the model's files: a local directory, or a Hugging Face repo in the local hub cache.

A model directory holds the published file names:
  model.safetensors                              the language model
  tokenizer-e351c8d8-checkpoint125.safetensors   Mimi (any `tokenizer-*.safetensors`)
  tokenizer_spm_32k_3.model                      the text tokenizer (any `*.model`)
  voices/ or voices.tgz                          voice prompts
  personaplex-arch.json                          optional architecture overrides
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..errors import ModelMissingError
from .digest import sha256_file

COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
PARTIAL_SUFFIX = ".incomplete"  # huggingface_hub's: blobs/<etag>.incomplete while it downloads
_REPO_ID = re.compile(r"\b[\w\-.]{1,96}\b/\b[\w\-.]{1,96}\b")

DEFAULT_MODEL = "nvidia/personaplex-7b-v1"
MIMI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"
LM_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer_spm_32k_3.model"
ARCH_FILE = "personaplex-arch.json"
VOICES_ARCHIVE = "voices.tgz"
VOICES_DIR = "voices"
# The voices the hub's archive holds, by name.
PACKAGED = tuple([f"NATF{i}" for i in range(4)] + [f"NATM{i}" for i in range(4)]
                 + [f"VARF{i}" for i in range(5)] + [f"VARM{i}" for i in range(5)])
# What `personaplex download` fetches from the hub (not dist.tgz, config.json, the card).
HUB_FILES = (LM_FILE, MIMI_FILE, TOKENIZER_FILE, VOICES_ARCHIVE)
# Fetched too when a repo holds it: a checkpoint of other dimensions (a fine-tune of another
# size, a tiny one for tests) describes itself with it. NVIDIA's holds none.
OPTIONAL_HUB_FILES = (ARCH_FILE,)
LM_CHECKPOINT_BYTES = 16_742_874_608  # model.safetensors: 8.37 B bf16 values and a header
# Their sizes, for a download's disk estimate before the hub is asked: the LM in bf16, Mimi
# in fp32 (385 MB), the SentencePiece model 553 kB, the 18 voices a few MB
# (reference-personaplex.md §1.5, §2.2).
HUB_FILE_BYTES = {LM_FILE: LM_CHECKPOINT_BYTES, MIMI_FILE: 385_000_000,
                  TOKENIZER_FILE: 553_000, VOICES_ARCHIVE: 10_000_000}


# `personaplex download --tiny` writes a tiny random-weight model here, in our own cache.
TINY_DIR = "tiny-random"
# A random-weight LM checkpoint (model/random_model.py) records its seed in its metadata.
RANDOM_WEIGHTS_KEY = "personaplex_random_weights_seed"


# encode and decode load Mimi alone, so a folder with just that file serves them.
MIMI_ONLY = "for encode and decode, a folder holding just tokenizer-*.safetensors will do"


class ModelNotFoundError(ModelMissingError):
    """The model, or one of its files, is not available on this machine."""


class AmbiguousModelFileError(ModelNotFoundError):
    """A model folder holds several candidates for one file (the same exit status: the
    model as asked for cannot be used until the user picks)."""


@dataclass
class ModelDir:
    path: Path
    name: str  # what the user asked for: a repo id or a directory
    hub: bool = False  # a snapshot in the Hugging Face cache (messages say how to fetch)

    def _pick(self, preferred: str, pattern: str, what: str) -> Path:
        exact = self.path / preferred
        if exact.is_file():
            return exact
        matches = sorted(p for p in self.path.glob(pattern) if p.is_file())
        if not matches:
            if self.hub:
                raise ModelNotFoundError(
                    f"{what} ({preferred}) is missing from model {self.name} in the local "
                    f"Hugging Face cache ({self.path}); run {download_hint(self.name)} to "
                    "fetch it, or pass --model DIR")
            raise ModelNotFoundError(f"{what} ({preferred}) is missing from model {self.name}")
        if len(matches) > 1:
            names = ", ".join(p.name for p in matches)
            raise AmbiguousModelFileError(
                f"model {self.name} has several files for {what} ({names})")
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

    def voices_dir(self) -> Path | None:
        """The packaged voices: `voices/`, or voices.tgz unpacked (once) into our cache when
        the folder holds only the archive. None when there are none."""
        folder = self.path / VOICES_DIR
        if folder.is_dir():
            return folder
        archive = self.path / VOICES_ARCHIVE
        if not archive.is_file():
            return None
        from .voices_archive import extract_voices

        return extract_voices(archive, unpacked_voices_dir(archive))

    def voices_hint(self) -> str:
        """What to do to get the packaged voices, when they are not here (for messages)."""
        if self.hub:
            return f"run {download_hint(self.name)}"
        return (f"copy {VOICES_DIR}/ or {VOICES_ARCHIVE} of {DEFAULT_MODEL} into "
                f"{self.path}")


def unpacked_voices_dir(archive: Path) -> Path:
    """Where `voices_dir` unpacks a folder's voices.tgz: our cache, one folder per archive
    path (the model folder itself may be read-only)."""
    key = hashlib.sha256(str(archive.resolve()).encode()).hexdigest()[:16]
    return tool_cache_dir() / "voices" / key


def tool_cache_dir() -> Path:
    """personaplex's own cache: remembered hashes, unpacked voices ($XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "personaplex"


def tiny_model_dir() -> Path:
    """Where `personaplex download --tiny` writes its model."""
    return tool_cache_dir() / TINY_DIR


def random_weights_seed(lm_file: Path) -> int | None:
    """The seed a random-weight LM checkpoint of model/random_model.py was drawn from;
    None for any other file (a trained checkpoint, a damaged or missing one)."""
    from .tensorfile import TensorFileError, read_metadata

    try:
        value = read_metadata(lm_file).get(RANDOM_WEIGHTS_KEY)
    except (OSError, TensorFileError):
        return None
    return int(value) if isinstance(value, str) and value.isdigit() else None


def resolve_model(spec: str | None) -> ModelDir:
    """A local directory as is; a repo id through the local hub cache only (no network).

    A repo id names its snapshot for `refs/main` in the hub cache (HF_HUB_CACHE / HF_HOME,
    as huggingface_hub reads them); see `download.cached_snapshot`.
    """
    spec = spec or DEFAULT_MODEL
    folder = local_model_dir(spec)
    if folder is not None:
        return ModelDir(folder, spec)
    # The cache only, never the network; each file is checked when it is asked for.
    return ModelDir(cached_snapshot(spec, require=()), spec, hub=True)


def local_model_dir(spec: str) -> Path | None:
    """The model folder `spec` names, or None when it names a hub repo (owner/name);
    ModelNotFoundError when it is neither (a file, a path that does not exist)."""
    local = Path(spec).expanduser()
    if local.is_dir():
        return local
    if local.is_file():
        raise ModelNotFoundError(f"--model expects a model directory, and {spec} is a file: "
                                 "give the folder that holds it and the other model files")
    if spec.startswith((".", "/", "~")) or local.exists():
        raise ModelNotFoundError(f"model directory {spec} does not exist")
    if spec.count("/") != 1:
        raise ModelNotFoundError(
            f"model {spec!r} is neither a directory nor a Hugging Face repo id (owner/name)")
    return None


# -- the hub cache, read without network ------------------------------------------------

def hf_home() -> Path:
    """HF_HOME as huggingface_hub computes it (default $XDG_CACHE_HOME/huggingface)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home)))


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub (its own rule, read here without importing it, so that
    shell completion stays fast)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        return hf_home() / "hub"
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def licence_url(repo: str) -> str:
    """The page where a gated repo's licence is accepted (always on huggingface.co)."""
    return f"https://huggingface.co/{repo}"


# -- file helpers shared by download, load and the voices archive ------------------------

SHA256 = re.compile(r"[0-9a-f]{64}")


def damaged_in_cache(path: Path, expected: str | None = None) -> str | None:
    """Why a file of a hub snapshot is not what the hub gave, or None. The hub names an LFS
    file by its sha256 (`expected`, else the name of the blob the snapshot links to, which
    the download verified); a file named otherwise (a small git file) has none to check."""
    blob = path.resolve()
    expected = expected or blob.name
    if not SHA256.fullmatch(expected):
        return None
    got = sha256_file(blob)
    if got == expected:
        return None
    return (f"{path.name} does not match the sha256 the hub gives for it (expected "
            f"{expected[:16]}…, found {got[:16]}…): it was damaged after the download")


def existing_parent(path: str | os.PathLike) -> Path:
    """`path` itself, or the nearest folder above it that exists (where it would be made)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def download_hint(repo: str = DEFAULT_MODEL, revision: str | None = None) -> str:
    """The command that fetches `repo` (used in messages)."""
    command = "personaplex download"
    if repo != DEFAULT_MODEL:
        command += f" --model {repo}"
    if revision:
        command += f" --revision {revision}"
    return f"`{command}`"


# -- the cache, without network ------------------------------------------------------------

def cached_snapshot(repo: str = DEFAULT_MODEL, revision: str | None = None, *,
                    cache_dir: str | os.PathLike | None = None,
                    require: Iterable[str] = HUB_FILES) -> Path:
    """The snapshot folder of `repo` at `revision` (default: main) in the hub cache.

    Reads the cache only: no request, no download, no lock. Raises ModelNotFoundError (exit
    3), naming `personaplex download`, when the snapshot is missing or lacks a `require`d file.
    Without `revision` and without `refs/main` (e.g. fetched by commit hash), the newest
    snapshot that holds every required file is used.
    """
    cache = cache_root(cache_dir)
    check_repo_id(repo)
    require = tuple(require)
    snapshot, missing = locate_snapshot(cache, repo, revision, require)
    label = repo if revision is None else f"{repo} (revision {revision})"
    if snapshot is None:
        raise ModelNotFoundError(
            f"model {label} is not in the local Hugging Face cache ({cache}); run "
            f"{download_hint(repo, revision)} first, or pass --model DIR ({MIMI_ONLY})")
    if missing:
        raise ModelNotFoundError(
            f"model {label} is incomplete in the local Hugging Face cache ({snapshot}: "
            f"missing {', '.join(missing)}); run {download_hint(repo, revision)} to finish it, "
            "or pass --model DIR")
    return snapshot


def repo_folder(cache: Path, repo: str) -> Path:
    """Where the hub cache keeps `repo` (its refs, snapshots and blobs)."""
    return cache / ("models--" + repo.replace("/", "--"))


def partial_blob(blob: Path) -> Path:
    """Where a blob being downloaded grows (huggingface_hub's name), kept to resume."""
    return blob.with_name(blob.name + PARTIAL_SUFFIX)


def partial_download_bytes(cache: Path, repo: str) -> int:
    """Bytes of `repo`'s interrupted downloads, which the next download continues."""
    try:
        return sum(p.stat().st_size for p in (repo_folder(cache, repo) / "blobs").glob(
            "*" + PARTIAL_SUFFIX) if p.is_file())
    except OSError:
        return 0


def locate_snapshot(cache: Path, repo: str, revision: str | None,
                    require: tuple[str, ...]) -> tuple[Path | None, list[str]]:
    """The snapshot of `repo` at `revision` (default: main, else the newest) holding all of
    `require`, or the first one found with what it lacks -> (snapshot or None, missing)."""
    storage = repo_folder(cache, repo)
    rev = revision or "main"
    commits: list[str] = []
    if COMMIT_HASH.fullmatch(rev):
        commits = [rev]
    else:
        try:
            commits = [(storage / "refs" / rev).read_text().strip()]
        except OSError:
            if revision is None:  # no refs/main: any snapshot, newest first
                try:
                    snaps = [p for p in (storage / "snapshots").iterdir() if p.is_dir()]
                except OSError:
                    snaps = []
                snaps.sort(key=lambda p: p.stat().st_mtime, reverse=True)
                commits = [p.name for p in snaps]
    best: tuple[Path | None, list[str]] = (None, [])
    for commit in commits:
        snapshot = storage / "snapshots" / commit
        if not snapshot.is_dir():
            continue
        missing = [name for name in require if not (snapshot / name).is_file()]
        if not missing:
            return snapshot, []
        if best[0] is None:
            best = (snapshot, missing)
    return best


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """The hub cache to use: the one given, else huggingface_hub's."""
    return Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()


def repo_id_problem(repo: str) -> str | None:
    """Why `repo` is not owner/name as the hub accepts it (huggingface_hub's rules, without
    importing it), or None when it is."""
    if (_REPO_ID.fullmatch(repo) and "--" not in repo and ".." not in repo
            and not repo.endswith(".git")):
        return None
    return f"{repo!r} is not a valid Hugging Face repo id (owner/name)"


def check_repo_id(repo: str) -> None:
    """ModelNotFoundError unless `repo` is owner/name as the hub accepts it."""
    problem = repo_id_problem(repo)
    if problem:
        raise ModelNotFoundError(problem)
