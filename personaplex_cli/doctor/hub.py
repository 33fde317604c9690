"""What a download still to come needs: a Hugging Face token (the model is gated) and room
on the disk that holds the hub cache. Both build on what the model check found."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import EXIT_OUTPUT
from ..model.files import existing_parent, hf_home, hub_cache_dir, licence_url
from ..model.voices_archive import format_size
from .check import FAIL, OK, WARN, Check
from .model import ModelState


def token_file() -> tuple[Path, str]:
    """The file `hf auth login` writes, and which setting named it."""
    configured = os.environ.get("HF_TOKEN_PATH")
    if configured:
        return Path(os.path.expandvars(os.path.expanduser(configured))), "HF_TOKEN_PATH"
    return hf_home() / "token", "HF_HOME" if os.environ.get("HF_HOME") else "default"


def find_token() -> str | None:
    """Where a Hugging Face token is (never the token itself), or None.

    huggingface_hub's order: HF_TOKEN (or the older HUGGING_FACE_HUB_TOKEN), then the token
    file; blank values do not count."""
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(variable, "").strip():
            return f"the {variable} environment variable"
    path, source = token_file()
    try:
        if path.read_text(errors="replace").strip():
            return f"the token file {path}" + (f" (from {source})" if source != "default" else "")
    except OSError:
        pass
    return None


def check_token(model: ModelState) -> Check:
    where = find_token()
    if where:
        return Check("hf-token", OK, f"a Hugging Face token is set, in {where}")
    path, _ = token_file()
    detail = f"no Hugging Face token (HF_TOKEN is unset, no token file at {path})"
    if model.kind == "folder":
        return Check("hf-token", OK, f"{detail}; not needed for a model folder")
    if model.complete:
        return Check("hf-token", OK, f"{detail}; not needed: the model is downloaded")
    return Check("hf-token", WARN, f"{detail}; the model is gated, so download needs one",
                 f"accept the licence at {licence_url(model.repo)}, then run `hf auth login` "
                 "or set HF_TOKEN")


def check_disk(model: ModelState) -> Check:
    cache = hub_cache_dir()
    where = existing_parent(cache)
    try:
        free = shutil.disk_usage(where).free
    except OSError as error:
        return Check("disk", WARN, f"cannot read the free space at {where} ({error.strerror})",
                     "check that the hub cache folder is readable")
    detail = f"{format_size(free)} free at {where} (the Hugging Face cache"
    detail += ")" if where == cache else f" {cache} will be made there)"
    if model.kind == "folder":
        return Check("disk", OK, f"{detail}; nothing to download (--model is a folder)")
    if model.kind == "invalid":
        return Check("disk", OK, detail)
    if model.missing_bytes == 0:
        return Check("disk", OK, f"{detail}; nothing left to download")
    detail += f"; the download still needs {format_size(model.missing_bytes)}"
    if free < model.missing_bytes:
        return Check("disk", FAIL, detail,
                     f"free {format_size(model.missing_bytes - free)} there, or point "
                     "HF_HUB_CACHE (or HF_HOME) at a disk with room", EXIT_OUTPUT)
    return Check("disk", OK, detail)
