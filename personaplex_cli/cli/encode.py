"""`personaplex encode`: audio -> Mimi codes (.mimi or .npy)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from ._common import (DEFAULT_MODEL, DeviceOpt, ForceOpt, ModelOpt, OutputOpt, QuietOpt,
                      Reporter, VerboseOpt, check_input, default_output, handle_errors,
                      load_mimi, open_output)


class CodeFormat(str, Enum):
    auto = "auto"
    mimi = "mimi"
    npy = "npy"


def _pick_format(requested: CodeFormat, output: str) -> str:
    if requested != CodeFormat.auto:
        return requested.value
    return "npy" if output.lower().endswith(".npy") else "mimi"


@handle_errors
def encode(
    input: Annotated[str, typer.Argument(metavar="IN", help="Audio file, or - for stdin.")],
    output: OutputOpt = None,
    format: Annotated[CodeFormat, typer.Option(
        "--format", help="Code file format; auto: .npy by suffix, else .mimi.")] = CodeFormat.auto,
    codebooks: Annotated[int, typer.Option(
        "--codebooks", "-k", min=1, max=32, help="Number of Mimi codebooks.")] = 8,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Encode audio to Mimi codes (12.5 frames per second).

    Reads anything libsndfile reads (WAV, FLAC, OGG, MP3...; WAV also as a stream on a pipe), mixes to mono and resamples to 24 kHz. Writes a streamable .mimi file, or a .npy array of codebooks x frames.
    """  # noqa: E501
    report = Reporter(quiet, verbose)
    check_input(input)
    fmt = _pick_format(format, output or "")
    target = output or default_output(input, "." + fmt)
    with open_output(target, force=force, inputs=(input,)) as sink:
        from ..audio.io import open_audio
        from ..codec import encode_stream
        from ..codes import CodeHeader, CodeWriter, save_npy

        with open_audio(input) as reader:  # a bad input fails before the model loads
            mimi, weights_sha256 = load_mimi(model, device, report)
            try:
                mimi.set_num_codebooks(codebooks)
            except ValueError as error:  # a Mimi with fewer than 32 codebooks
                raise typer.BadParameter(str(error), param_hint="'--codebooks'") from None
            # The sample count is known up front only without resampling; on a seekable
            # output it is patched in at the end anyway.
            known = reader.num_frames if reader.sample_rate == mimi.sample_rate else None
            header = CodeHeader(num_codebooks=codebooks, num_samples=known,
                                weights_sha256=weights_sha256)
            num_frames = None if known is None else -(-known // mimi.frame_size)
            report.info(f"input: {reader.sample_rate} Hz, {reader.channels} channel(s)")
            chunks = []
            writer = CodeWriter(sink, header, num_frames) if fmt == "mimi" else None
            write = writer.write if writer else chunks.append
            with report.progress("encoding", reader.duration) as advance:
                num_samples = encode_stream(
                    mimi, reader.blocks(reader.sample_rate // 5), reader.sample_rate, write,
                    progress=lambda n: advance(n / reader.sample_rate))
            if writer is not None:
                writer.close(num_samples=num_samples)
            else:
                import numpy as np

                save_npy(sink, np.concatenate(chunks, axis=1))
