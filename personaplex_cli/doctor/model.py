"""The model's files, in the hub cache or a model folder, and its voices: looked at on disk
(`stat`, and each safetensors file's header through model/tensorfile.py), never loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import EXIT_MODEL_INVALID, EXIT_MODEL_MISSING, ModelMissingError
from ..model.files import (DEFAULT_MODEL, HUB_FILE_BYTES, HUB_FILES, LM_FILE, MIMI_FILE,
                           MIMI_ONLY, TOKENIZER_FILE, VOICES_ARCHIVE, VOICES_DIR,
                           AmbiguousModelFileError, ModelDir, check_repo_id, damaged_in_cache,
                           download_hint,
                           hub_cache_dir, local_model_dir, locate_snapshot,
                           partial_download_bytes, random_weights_seed, tiny_model_dir,
                           unpacked_voices_dir)
from ..model.tensorfile import TensorFileError, read_header
from ..model.voices_archive import format_size, is_extracted
from ..prompts.voices import DEFAULT_VOICE, WITHOUT_PACKAGED, voices_in
from .check import FAIL, OK, WARN, Check


@dataclass
class ModelState:
    """What the model check found; the token and disk checks build on it."""
    kind: str  # "hub" (a repo id, from the hub cache), "folder", or "invalid" (neither)
    complete: bool
    missing_bytes: int = 0  # still to download (hub only; estimates)
    repo: str = DEFAULT_MODEL  # the repo id (hub only)


def check_model(spec: str | None, verify: bool = False) -> tuple[Check, ModelState]:
    """The model's four files (hub snapshot or folder), without loading any of them; with
    `verify`, a hub snapshot's files are read whole against the sha256 the hub gave."""
    spec = spec or DEFAULT_MODEL
    try:
        folder = local_model_dir(spec)
    except ModelMissingError as error:  # neither a folder nor a repo id: the resolver's words
        return (Check("model", FAIL, error.message, "give --model a model folder or a Hugging "
                      f"Face repo id (default {DEFAULT_MODEL})", EXIT_MODEL_MISSING),
                ModelState("invalid", False))
    if folder is not None:
        return _check_folder(folder, spec, verify)
    return _check_hub(spec, verify)


# -- one file, and the voices -------------------------------------------------------------------

def safetensors_header(path: Path) -> tuple[int, str | None]:
    """(tensor count, problem) from a .safetensors file's header, read without torch by
    model/tensorfile.py, which also catches a truncated file (its last tensor must end
    exactly at the end of the file)."""
    try:
        return len(read_header(path)), None
    except TensorFileError as error:
        return 0, str(error)


def _describe_file(path: Path, label: str) -> tuple[str, str | None]:
    """'name 1.2 GB (475 tensors)' and a problem, if any (safetensors files are checked)."""
    size = path.stat().st_size
    text = f"{label} {format_size(size)}"
    if path.name.endswith(".safetensors"):
        count, problem = safetensors_header(path)
        if problem:
            return text, f"{label} is {problem}"
        text += f" ({count} tensors)"
    return text, None


def _count_voices(folder: Path) -> int:
    try:
        return len(voices_in(folder, "packaged"))
    except OSError:
        return 0


def _voices_text(folder: Path) -> tuple[str, bool]:
    """How the voices stand in a model folder, as ModelDir.voices_dir finds them, without
    unpacking anything -> (text, any voice there)."""
    def counted(where: Path) -> tuple[str, int]:
        n = _count_voices(where)
        return f"{n} voice{'s' if n != 1 else ''}", n

    voices = folder / VOICES_DIR
    archive = folder / VOICES_ARCHIVE
    if voices.is_dir():
        text, n = counted(voices)
        return f"{VOICES_DIR}/ {text}", n > 0
    if archive.is_file():
        unpacked = unpacked_voices_dir(archive)
        if not is_extracted(archive, unpacked):
            return f"{VOICES_DIR}/ not unpacked yet (done on first use)", True
        text, n = counted(unpacked)
        return f"{VOICES_DIR}/ {text} (unpacked from {VOICES_ARCHIVE} into {unpacked})", n > 0
    return "", False


# -- in the hub cache ---------------------------------------------------------------------------

def _run(hint: str) -> str:
    """'run `personaplex download`', first unsetting HF_HUB_OFFLINE when it is set."""
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return f"unset HF_HUB_OFFLINE and run {hint}"
    return f"run {hint}"


def _check_hub(repo: str, verify: bool = False) -> tuple[Check, ModelState]:
    try:
        check_repo_id(repo)
    except ModelMissingError as error:
        return (Check("model", FAIL, error.message, f"give a repo id such as {DEFAULT_MODEL}",
                      EXIT_MODEL_MISSING), ModelState("invalid", False))
    cache = hub_cache_dir()
    hint = download_hint(repo)
    everything = sum(HUB_FILE_BYTES.values())
    partial = partial_download_bytes(cache, repo)
    snapshot, missing = locate_snapshot(cache, repo, None, HUB_FILES)
    if snapshot is None:
        need = max(0, everything - partial)
        return (Check("model", FAIL, f"{repo} is not in the Hugging Face cache ({cache})",
                      f"{_run(hint)} to fetch it ({format_size(need)}), "
                      f"or pass --model DIR ({MIMI_ONLY})", EXIT_MODEL_MISSING),
                ModelState("hub", False, need, repo))
    parts, problems = [], []
    for name in HUB_FILES:
        path = snapshot / name
        if name in missing:
            continue
        text, problem = _describe_file(path, name)
        if verify and not problem:
            problem = damaged_in_cache(path)
        if problem:
            problems.append((problem, path))
        parts.append(text)
    voices, _ = _voices_text(snapshot)
    if voices:
        parts.append(voices)
    where = f"{repo} (snapshot {snapshot.name[:12]} in {cache})"
    need = 0
    if missing:
        need = max(0, sum(HUB_FILE_BYTES.get(n, 0) for n in missing) - partial)
    detail = f"{where}: {', '.join(parts) or 'no model files'}"
    if missing:
        return (Check("model", FAIL, f"{detail}; missing {', '.join(missing)}",
                      f"{_run(hint)} to fetch {', '.join(missing)} "
                      f"({format_size(need)})", EXIT_MODEL_MISSING),
                ModelState("hub", False, need, repo))
    if problems:
        problem, path = problems[0]
        return (Check("model", FAIL, f"{detail}; {problem}",
                      f"remove it (rm \"$(readlink -f {path})\" {path}) and run {hint} again",
                      EXIT_MODEL_INVALID), ModelState("hub", False, 0, repo))
    verified = ", each file matching the hub's sha256" if verify else ""
    return (Check("model", OK, f"{detail}; complete{verified}"),
            ModelState("hub", True, 0, repo))


# -- in a folder --------------------------------------------------------------------------------

def _check_folder(folder: Path, spec: str, verify: bool = False
                  ) -> tuple[Check, ModelState]:
    model = ModelDir(folder, spec)
    parts, missing, problems = [], [], []
    mimi_ok = False
    seed = None
    for what, pick, wanted in (("Mimi", model.mimi_file, MIMI_FILE),
                               ("LM", model.lm_file, LM_FILE),
                               ("text tokenizer", model.tokenizer_file, TOKENIZER_FILE)):
        try:
            path = pick()
        except AmbiguousModelFileError as error:
            problems.append(error.message)
            continue
        except ModelMissingError:
            missing.append(wanted)
            continue
        text, problem = _describe_file(path, path.name)
        if problem:
            problems.append(problem)
        elif what == "Mimi":
            mimi_ok = True
        elif what == "LM":
            seed = random_weights_seed(path)
        parts.append(text)
    voices, has_voices = _voices_text(folder)
    no_voices = [] if has_voices else [f"{VOICES_DIR}/ or {VOICES_ARCHIVE}"]
    if voices:
        parts.append(voices)
    arch = model.arch_file()
    if arch:
        parts.append(f"{arch.name} (architecture overrides)")
    detail = f"folder {folder}: {', '.join(parts) or 'no model files'}"
    if verify:  # a folder keeps no sha256 of its files: nothing to check them against
        detail += " (not verified: a folder has no checksums from the hub)"
    if problems:
        return (Check("model", FAIL, f"{detail}; {problems[0]}",
                      "replace the file with a complete copy (or use the hub model: "
                      f"{download_hint()})", EXIT_MODEL_INVALID), ModelState("folder", False, 0))
    if missing:
        missing += no_voices
        works = ("; encode and decode will work (they need only Mimi); reply, talk and "
                 "voices create will not" if mimi_ok else "")
        return (Check("model", FAIL, f"{detail}; missing {', '.join(missing)}{works}",
                      f"put {', '.join(missing)} into {folder}, or use the hub model: "
                      f"{download_hint()}", EXIT_MODEL_MISSING), ModelState("folder", False, 0))
    if no_voices:
        # Everything runs but a packaged voice by name: a warning, as for absent hardware.
        return (Check("model", WARN, f"{detail}; no packaged voices ({no_voices[0]}): "
                      "encode, decode and voices create work, and reply and talk with "
                      f"--voice FILE or --voice ''; a packaged voice by name (the default "
                      f"{DEFAULT_VOICE} among them) does not",
                      f"{model.voices_hint()}; {WITHOUT_PACKAGED}"),
                ModelState("folder", True, 0))
    if seed is not None:
        # Complete and working, and no model of speech: said so, as for absent hardware.
        tiny = " tiny" if folder.resolve() == tiny_model_dir().resolve() else ""
        return (Check("model", WARN, f"{detail}; a{tiny} model with random weights (seed "
                      f"{seed}): every command runs on it, but what it says is noise",
                      f"for speech, run {download_hint()} and use that model (drop --model "
                      "or PERSONAPLEX_MODEL)"), ModelState("folder", True, 0))
    return Check("model", OK, f"{detail}; complete"), ModelState("folder", True, 0)
