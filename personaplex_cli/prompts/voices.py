"""Where voices live and how a `--voice` value finds one.

Two places hold voices by name: the model's packaged voices (`voices/` in the model folder,
unpacked from the hub's voices.tgz: NATF0-3, NATM0-3, VARF0-4, VARM0-4) and the user's own
(`$PERSONAPLEX_VOICES_DIR`, default `$XDG_DATA_HOME/personaplex/voices`, made by
`personaplex voices create`). The user's own win when a name is in both. A value with a
`.pt` or `.wav` suffix (or any path that exists) is a file instead.

A packaged name whose file is not here is not an unknown voice: like the model's other
files, it is missing from this machine (exit 3), and the message says how to get it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, ModelMissingError
from ..model.files import PACKAGED, download_hint

DEFAULT_VOICE = "NATF2"
VOICE_SUFFIXES = (".pt", ".wav")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# What reply and talk take instead of a packaged voice.
WITHOUT_PACKAGED = "or give --voice FILE (a .pt or .wav) or --voice '' (none)"


class VoiceNotFoundError(InputError):
    """No voice by that name or path."""


class VoiceNotDownloadedError(ModelMissingError):
    """One of the packaged voices, not on this machine."""


@dataclass(frozen=True)
class Voice:
    name: str
    path: Path
    origin: str  # "packaged", "user" or "file"

    @property
    def kind(self) -> str:
        """"pt" (stored embeddings) or "recording" (anything else: audio to encode)."""
        return "pt" if self.path.suffix.lower() == ".pt" else "recording"


def user_voices_dir() -> Path:
    configured = os.environ.get("PERSONAPLEX_VOICES_DIR")
    if configured:
        return Path(configured).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "personaplex" / "voices"


def voices_in(folder: Path | None, origin: str) -> dict[str, Voice]:
    """The voices a folder holds by name: its `*.pt` files (doctor counts them too)."""
    if folder is None or not folder.is_dir():
        return {}
    return {path.stem: Voice(path.stem, path, origin)
            for path in sorted(folder.glob("*.pt")) if path.is_file()}


def catalog(model_voices: Path | None) -> dict[str, Voice]:
    """Every voice by name: the model's packaged ones, then the user's own over them."""
    return {**voices_in(model_voices, "packaged"), **voices_in(user_voices_dir(), "user")}


def packaged_name(name: str) -> str | None:
    """The packaged voice `name` stands for (any case), or None."""
    return name.upper() if name.upper() in PACKAGED else None


def find_voice(spec: str, model_voices: Path | None,
               how_to_get: str = f"run {download_hint()}") -> Voice | None:
    """`--voice` value -> Voice; '' means no voice prompt at all. `how_to_get` says how the
    packaged voices come onto this machine (ModelDir.voices_hint)."""
    if spec == "":
        return None
    path = Path(spec).expanduser()
    if path.suffix.lower() in VOICE_SUFFIXES or os.sep in spec or path.exists():
        if path.is_dir():
            raise VoiceNotFoundError(f"voice {spec} is a directory: name a .pt or .wav "
                                     "file in it")
        if not path.is_file():
            if os.sep not in spec and path.suffix.lower() == ".pt":
                # NATF2.pt, as NVIDIA's client names a packaged voice (serve takes it too)
                try:
                    return find_named(path.stem, model_voices, how_to_get)
                except VoiceNotFoundError:
                    pass
            raise VoiceNotFoundError(f"voice file {spec} does not exist")
        return Voice(path.stem, path, "file")
    try:
        return find_named(spec, model_voices, how_to_get)
    except VoiceNotFoundError as error:
        raise VoiceNotFoundError(f"{error.message}; or give a .pt or .wav file") from None


def find_named(name: str, model_voices: Path | None,
               how_to_get: str = f"run {download_hint()}") -> Voice:
    """A packaged or user voice by its name (exact, else the one case-insensitive match);
    never a file (what `serve` lets a caller name)."""
    voices = catalog(model_voices)
    if name in voices:
        return voices[name]
    matches = [known for known in voices if known.lower() == name.lower()]
    if len(matches) == 1:
        return voices[matches[0]]
    packaged = packaged_name(name)
    if packaged:
        where = f"there is no {packaged}.pt in {model_voices}; " if model_voices else ""
        raise VoiceNotDownloadedError(
            f"voice {packaged} is one of the packaged voices, but it is not on this machine: "
            f"{where}{how_to_get}; {WITHOUT_PACKAGED}")
    if not voices:
        where = f"the model has no packaged voices ({how_to_get})"
    else:
        where = f"known voices: {', '.join(sorted(voices))}"
    raise VoiceNotFoundError(f"unknown voice {name!r}; {where}")


def check_name(name: str) -> str:
    if not NAME_RE.match(name) or name.endswith((".pt", ".wav")):
        raise InputError(f"{name!r} cannot be a voice name: use letters, digits, '-', '_' "
                         "and '.', without a suffix")
    return name
