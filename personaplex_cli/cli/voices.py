"""`personaplex voices`: list, show and create the voices a persona speaks with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..core.config import FRAME_SECONDS, SAMPLE_RATE
from ..errors import InputError
from ..outputs import check_input, open_output, reads_model
from .options import (DEFAULT_MODEL, Bf16DtypeOpt, DeviceOpt, ForceOpt, ModelOpt, QuietOpt,
                      VerboseOpt, voice_names)
from .output import Output

app = typer.Typer(help="List, show and create voices.", no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]})

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]
MIN_SECONDS = 1.0  # shorter recordings carry too little of a voice
ADVISED = (10.0, 20.0)  # seconds of clear speech that make a good voice
LONG_SECONDS = 30.0  # NVIDIA's voices are a few seconds; much longer only costs priming time
MIN_SPEECH_SHARE = 0.5  # below this, the recording is mostly silence or noise


def _describe(name: str) -> str:
    """NVIDIA's naming: NAT natural, VAR variety; F female, M male; then a number."""
    family = {"NAT": "natural", "VAR": "variety"}.get(name[:3])
    gender = {"F": "female", "M": "male"}.get(name[3:4])
    if family and gender and name[4:].isdigit():
        return f"{family} {gender} voice {name[4:]}"
    return ""


def _description(name: str, origin: str) -> str:
    if origin == "user":
        from ..model.files import PACKAGED

        return "your own voice" + (", over the packaged one" if name in PACKAGED else "")
    return _describe(name) if origin == "packaged" else "a voice file"


def _packaged_voices(model: str) -> tuple[Path | None, str]:
    """The model's voices folder (None when it has none here), and what to do to get the
    packaged voices onto this machine."""
    from ..errors import ModelMissingError
    from ..model.files import download_hint, repo_id_problem, resolve_model

    try:
        files = resolve_model(model)
    except ModelMissingError as error:
        if repo_id_problem(model) is None:  # a repo id that is not in the cache
            return None, f"{model} is not downloaded: run {download_hint(model)}"
        return None, error.message
    return files.voices_dir(), files.voices_hint()


def _seconds(path: Path, model: str) -> float | None:
    """A voice's length: a .pt's stored frames (the voice checked against the model, when
    the model is here), a recording's duration."""
    if path.suffix.lower() == ".pt":
        from ..errors import PersonaplexError
        from ..model.files import resolve_model
        from ..model.load import read_arch
        from ..prompts.voice import check_voice, load_voice_pt

        voice = load_voice_pt(path)
        try:
            lm = read_arch(resolve_model(model)).lm
        except PersonaplexError:
            lm = None  # no model here to check it against: its layout was checked
        if lm is not None:
            check_voice(path, voice, lm)
        return (len(voice.embeddings) + 1) * FRAME_SECONDS
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
    from ..model.files import PACKAGED
    from ..prompts.voices import catalog, user_voices_dir

    out = Output(quiet, verbose)
    folder, how_to_get = _packaged_voices(model)
    voices = catalog(folder)
    rows = []
    for name in sorted(set(PACKAGED) | set(voices), key=lambda n: (n not in PACKAGED, n)):
        voice = voices.get(name)
        origin = voice.origin if voice else "packaged"
        rows.append({"name": name, "origin": origin,
                     "description": _description(name, origin),
                     "path": str(voice.path) if voice else None,
                     "available": voice is not None})
    if json_output:
        out.result_json({"voices": rows, "user_voices_dir": str(user_voices_dir())})
        return
    absent = sum(not row["available"] for row in rows)
    if absent:
        out.warn(f"{absent} of the {len(PACKAGED)} packaged voices are not on this "
                 f"machine: {how_to_get}")
    widths = {key: max(len(row[key]) for row in rows) for key in ("name", "origin",
                                                                  "description")}
    for row in rows:
        out.result("  ".join(f"{row[key]:<{width}}" for key, width in widths.items())
                   + f"  {row['path'] or 'not downloaded'}")


@app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="A voice name, or a .pt/.wav file.",
                                        autocompletion=voice_names)],
    model: ModelOpt = DEFAULT_MODEL,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Show what a voice is, how long it is and where it lives."""
    from ..prompts.voices import find_voice

    out = Output(quiet, verbose)
    if name == "":
        raise InputError("'' means no voice at all; name a voice to show")
    voice = find_voice(name, *_packaged_voices(model))
    seconds = _seconds(voice.path, model)
    info = {"name": voice.name, "origin": voice.origin,
            "description": _description(voice.name, voice.origin),
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
    from ..prompts.voices import check_name, packaged_name, user_voices_dir

    from ..prompts.persona import record_voice
    from ..errors import OutputError
    from ..model.model import Model
    from ..prompts.voice import read_voice_audio, save_voice_pt, speech_seconds

    out = Output(quiet, verbose)
    check_name(name)
    check_input(recording)
    reads_model(model)
    packaged = packaged_name(name)
    if packaged and not force:
        raise OutputError(f"{name} is the name of a packaged voice"
                          f"{'' if name == packaged else f', {packaged}'}; yours would stand "
                          "in for it wherever it is named: choose another name, or use "
                          "--force to do so anyway")
    folder = user_voices_dir()
    target = folder / f"{name}.pt"
    if target.exists() and not force:
        raise OutputError(f"voice {name} exists ({target}); use --force to replace it")
    pcm = read_voice_audio(recording, SAMPLE_RATE)  # a bad recording fails first
    seconds = len(pcm) / SAMPLE_RATE
    advised = f"{ADVISED[0]:.0f} to {ADVISED[1]:.0f} s of clear speech works best"
    if seconds < MIN_SECONDS:
        raise InputError(f"{recording} is {seconds:.2f} s long; a voice needs at least "
                         f"{MIN_SECONDS:.0f} s of speech ({advised})")
    speech = speech_seconds(pcm, SAMPLE_RATE)
    if speech < MIN_SPEECH_SHARE * seconds:
        out.warn(f"{recording} is mostly silence or noise: about {speech:.1f} s of its "
                 f"{seconds:.1f} s sounds like speech; {advised}")
    elif seconds < ADVISED[0]:
        out.warn(f"{recording} is only {seconds:.1f} s long; {advised}")
    if seconds > LONG_SECONDS:
        out.warn(f"{recording} is {seconds:.0f} s long; {ADVISED[0]:.0f} to "
                 f"{ADVISED[1]:.0f} s works as well and primes faster")
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
    if packaged:
        out.warn(f"{name} now stands in for the packaged voice {packaged}; remove {target} "
                 "to have the packaged one back")
    out.note("Use only voices whose speaker agreed to it.")
    out.info(f"saved {seconds:.1f} s of voice as {target}")
    out.result(str(target))
