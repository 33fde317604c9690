"""`personaplex voices`: list, show and create the voices a persona speaks with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..core.config import FRAME_SECONDS, SAMPLE_RATE
from ..errors import InputError
from .files import check_input, open_output
from .options import (DEFAULT_MODEL, Bf16DtypeOpt, DeviceOpt, ForceOpt, ModelOpt, QuietOpt,
                      VerboseOpt)
from .output import Output

app = typer.Typer(help="List, show and create voices.", no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]})

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]
MIN_SECONDS = 1.0  # shorter recordings carry too little of a voice
LONG_SECONDS = 30.0  # NVIDIA's voices are a few seconds; much longer only costs priming time


def _describe(name: str) -> str:
    """NVIDIA's naming: NAT natural, VAR variety; F female, M male; then a number."""
    family = {"NAT": "natural", "VAR": "variety"}.get(name[:3])
    gender = {"F": "female", "M": "male"}.get(name[3:4])
    if family and gender and name[4:].isdigit():
        return f"{family} {gender} voice {name[4:]}"
    return ""


def _model_voices(model: str) -> tuple[Path | None, str | None]:
    """The model's voices folder, or (None, why not) when the model is not here."""
    from ..errors import ModelMissingError
    from ..model.files import resolve_model

    try:
        return resolve_model(model).voices_dir(), None
    except ModelMissingError as error:
        return None, error.message


def _seconds(path: Path) -> float | None:
    """A voice's length: a .pt's stored frames, a recording's duration."""
    if path.suffix.lower() == ".pt":
        from ..prompts.voice import load_voice_pt

        return (len(load_voice_pt(path).embeddings) + 1) * FRAME_SECONDS
    import soundfile

    try:
        return soundfile.info(str(path)).duration
    except RuntimeError:  # as a .pt that is not a voice is refused, so is such a recording
        raise InputError(f"{path} is not a readable recording") from None


@app.command("list")
def list_voices(
    model: ModelOpt = DEFAULT_MODEL,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """List the model's packaged voices and your own."""
    from ..prompts.voices import PACKAGED, catalog, user_voices_dir

    out = Output(quiet, verbose)
    folder, missing = _model_voices(model)
    voices = catalog(folder)
    rows = []
    for name in sorted(set(PACKAGED) | set(voices), key=lambda n: (n not in PACKAGED, n)):
        voice = voices.get(name)
        rows.append({"name": name,
                     "origin": voice.origin if voice else "packaged",
                     "description": _describe(name) if name in PACKAGED else "your own voice",
                     "path": str(voice.path) if voice else None,
                     "available": voice is not None})
    if json_output:
        out.result_json({"voices": rows, "user_voices_dir": str(user_voices_dir())})
        return
    if missing:
        out.warn(f"{missing}; the packaged voices are listed but not on this machine")
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        where = row["path"] or "not downloaded"
        out.result(f"{row['name']:<{width}}  {row['origin']:<8}  {row['description']:<24}  "
                   f"{where}")


@app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="A voice name, or a .pt/.wav file.")],
    model: ModelOpt = DEFAULT_MODEL,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Show what a voice is, how long it is and where it lives."""
    from ..prompts.voices import find_voice

    out = Output(quiet, verbose)
    folder, _ = _model_voices(model)
    voice = find_voice(name, folder)
    if voice is None:
        raise InputError("'' means no voice at all; name a voice to show")
    seconds = _seconds(voice.path)
    info = {"name": voice.name, "origin": voice.origin,
            "description": _describe(voice.name) if voice.origin == "packaged"
            else "your own voice" if voice.origin == "user" else "a voice file",
            "kind": "stored embeddings (.pt)" if voice.kind == "pt" else "a recording",
            "seconds": None if seconds is None else round(seconds, 2),
            "path": str(voice.path), "bytes": voice.path.stat().st_size}
    if json_output:
        out.result_json(info)
        return
    for key, value in info.items():
        out.result(f"{key + ':':<13}{'' if value is None else value}")


@app.command("create")
def create(
    recording: Annotated[str, typer.Argument(
        help="A recording of the voice (any format libsndfile reads; - for stdin).")],
    name: Annotated[str, typer.Argument(help="The new voice's name.")],
    dtype: Bf16DtypeOpt = None,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Make a voice from a recording, saved as a .pt that NVIDIA's code also loads.

    The recording is normalised to -24 LUFS, Mimi-encoded and run through the voice phase,
    as NVIDIA's code does; 10 to 20 s of clear speech works best. The voice is stored in
    $PERSONAPLEX_VOICES_DIR. Precision defaults to bf16, the released model's, whatever the
    device (NVIDIA's code needs that to load it).
    """
    from ..prompts.voices import check_name, user_voices_dir

    from ..conversation import record_voice
    from ..errors import OutputError
    from ..model.model import Model
    from ..prompts.voice import read_voice_audio, save_voice_pt

    out = Output(quiet, verbose)
    check_name(name)
    check_input(recording)
    folder = user_voices_dir()
    target = folder / f"{name}.pt"
    if target.exists() and not force:
        raise OutputError(f"voice {name} exists ({target}); use --force to replace it")
    pcm = read_voice_audio(recording, SAMPLE_RATE)  # a bad recording fails first
    seconds = len(pcm) / SAMPLE_RATE
    if seconds < MIN_SECONDS:
        raise InputError(f"{recording} is {seconds:.2f} s long; a voice needs at least "
                         f"{MIN_SECONDS:.0f} s of speech (10 to 20 s works best)")
    if seconds > LONG_SECONDS:
        out.warn(f"{recording} is {seconds:.0f} s long; 10 to 20 s works as well and "
                 "primes faster")
    the_model = Model.open(model, device, dtype.value if dtype else "bf16")
    out.info(f"model: {the_model.path}; device {the_model.device}, "
             f"{str(the_model.dtype).removeprefix('torch.')}")
    voice = record_voice(the_model, pcm)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"cannot create the voices folder {folder}: "
                          f"{error.strerror or error}") from None
    with open_output(str(target), force=force, inputs=(recording,)) as sink:
        save_voice_pt(sink, voice)
    out.note("Use only voices whose speaker agreed to it.")
    out.info(f"saved {seconds:.1f} s of voice as {target}")
    out.result(str(target))
