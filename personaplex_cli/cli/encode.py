"""`personaplex encode`: audio -> Mimi codes (.mimi or .npy)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from ..outputs import check_input, open_output, reads_model, with_suffix
from .options import (DEFAULT_MODEL, DeviceOpt, ForceOpt, ModelOpt, QuietOpt, VerboseOpt,
                      agreed_format)
from .output import Output


class CodeFormat(str, Enum):
    auto = "auto"
    mimi = "mimi"
    npy = "npy"


def _pick_format(requested: CodeFormat, output: str | None) -> str:
    """--format and the output's suffix (.npy, .mimi) must agree; else .mimi."""
    if output is None:  # the default name follows the format
        return "mimi" if requested == CodeFormat.auto else requested.value
    from ..codes import code_suffix_problem

    if requested == CodeFormat.auto and code_suffix_problem(output):  # as decode: --format
        raise typer.BadParameter(code_suffix_problem(output) + "; or give --format",
                                 param_hint="'--output'")
    by_suffix = {".npy": "npy", ".mimi": "mimi"}.get(Path(output).suffix.lower())
    asked = None if requested == CodeFormat.auto else requested.value
    return agreed_format(output, by_suffix, asked) or "mimi"


def encode(
    input: Annotated[str, typer.Argument(metavar="IN", help="Audio file, or - for stdin.")],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", metavar="OUT",
        help="Code file, or - for stdout (default: IN with .mimi or .npy; stdout when IN "
        "is -).")] = None,
    format: Annotated[CodeFormat, typer.Option(
        "--format", help="Code file format; auto: .npy by suffix, else .mimi.")] = CodeFormat.auto,
    codebooks: Annotated[int, typer.Option(
        "--codebooks", "-k", min=1, max=32, metavar="N", help="Number of Mimi codebooks.")] = 8,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Encode audio to Mimi codes (12.5 frames per second).

    Reads anything libsndfile reads (WAV, FLAC, OGG, MP3...; WAV also as a stream on a pipe), mixes to mono and resamples to 24 kHz. Writes a streamable .mimi file, or a .npy array of codebooks x frames.
    """  # noqa: E501
    out = Output(quiet, verbose)
    check_input(input)
    fmt = _pick_format(format, output)
    target = output or with_suffix(input, "." + fmt)
    reads_model(model)
    with open_output(target, force=force, inputs=(input,)) as sink:
        from ..audio.frames import InputFrames
        from ..audio.io import open_audio
        from ..codec import CHUNK_FRAMES, encode_stream
        from ..codes import CodeHeader, CodeWriter, save_npy
        from ..core.config import CODEC_WINDOW
        from ..model.model import Model

        # A bad input fails before the model loads.
        with open_audio(input, warn=out.warn) as reader:
            out.info(f"input: {reader.sample_rate} Hz, {reader.channels} channel(s), "
                     f"{'%.2f s' % reader.duration if reader.duration else 'length unknown'}")
            the_model = Model.open(model, device)
            out.info(f"model: {the_model.path}")
            out.info(f"device: {the_model.device}")
            mimi = the_model.mimi
            out.debug(f"Mimi weights sha256 {the_model.mimi_sha256}")
            try:
                mimi.set_num_codebooks(codebooks)
            except ValueError as error:  # a Mimi with fewer than 32 codebooks
                raise typer.BadParameter(str(error), param_hint="'--codebooks'") from None
            with out.progress("encoding", reader.duration) as advance:
                frames = InputFrames(reader, progress=advance)
                header = CodeHeader(num_codebooks=codebooks,
                                    num_samples=frames.expected_samples,
                                    weights_sha256=the_model.mimi_sha256, window=CODEC_WINDOW)
                chunks = []
                writer = CodeWriter(sink, header, frames.expected_frames) \
                    if fmt == "mimi" else None
                n = encode_stream(mimi, frames.chunks(CHUNK_FRAMES),
                                  writer.write if writer else chunks.append)
            if writer is not None:
                writer.close(num_samples=frames.samples)
            else:
                import numpy as np

                save_npy(sink, np.concatenate(chunks, axis=1))
            out.debug(f"{n} frames, {frames.samples} samples at 24 kHz")
