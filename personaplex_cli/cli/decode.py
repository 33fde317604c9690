"""`personaplex decode`: Mimi codes (.mimi or .npy) -> audio."""

from __future__ import annotations

import sys
from enum import Enum
from typing import Annotated

import typer

from ._common import (DEFAULT_MODEL, DeviceOpt, ForceOpt, ModelOpt, OutputOpt, QuietOpt,
                      Reporter, VerboseOpt, check_input, default_output, handle_errors,
                      load_mimi, open_output)


class SampleFormat(str, Enum):
    s16 = "s16"
    f32 = "f32"


def _open_codes(path: str):
    """-> (num_samples or None, weights sha or None, iterator of [K, n] code chunks)."""
    from ..codes import CodeFileError, CodeReader, load_npy, sniff_format

    stream = sys.stdin.buffer if path == "-" else open(path, "rb")
    head = stream.read(8)
    kind = sniff_format(head)
    if kind == "mimi":
        reader = CodeReader(stream, prefix=head)
        header = reader.header
        num_samples = header.num_samples
        if num_samples is None and reader.num_frames is not None:
            num_samples = reader.num_frames * header.frame_size
        return num_samples, header.weights_sha256, reader.frames(max_frames=25)
    if kind == "npy":
        codes = load_npy(stream, prefix=head)
        return None, None, iter([codes])
    if not head:
        raise CodeFileError(f"{path}: empty input")
    raise CodeFileError(f"{path}: not a .mimi or .npy code file")


@handle_errors
def decode(
    input: Annotated[str, typer.Argument(metavar="IN", help="Code file (.mimi/.npy), or -.")],
    output: OutputOpt = None,
    sample_format: Annotated[SampleFormat, typer.Option(
        "--sample-format", help="s16: 16-bit PCM; f32: the decoder's exact float values, "
        "unclipped.")] = SampleFormat.s16,
    raw: Annotated[bool, typer.Option("--raw", help="Headerless little-endian PCM.")] = False,
    rate: Annotated[int, typer.Option(
        "--rate", "-r", min=1000, max=384000, help="Output sample rate in Hz.")] = 24000,
    ignore_weights: Annotated[bool, typer.Option(
        "--ignore-weights", help="Decode even if the codes came from other Mimi weights.")
    ] = False,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Decode Mimi codes to audio: WAV (exact header when the length is known) or raw PCM.

    The output is trimmed to the original length when the code file records it.
    """
    report = Reporter(quiet, verbose)
    check_input(input)
    target = output or default_output(input, ".raw" if raw else ".wav")
    with open_output(target, force=force, inputs=(input,)) as sink:
        from ..audio.resample import StreamResampler
        from ..audio.wav import RawWriter, WavWriter
        from ..codec import decode_stream
        from ..errors import InputError

        num_samples, made_with, chunks = _open_codes(input)
        mimi, weights_sha256 = load_mimi(model, device, report)
        if made_with and made_with != weights_sha256 and not ignore_weights:
            raise InputError("these codes were made with other Mimi weights "
                             f"(sha256 {made_with[:12]}..., ours {weights_sha256[:12]}...); "
                             "pass --ignore-weights to decode anyway")
        resampler = StreamResampler(mimi.sample_rate, rate)
        length = num_samples if num_samples is not None and resampler.passthrough else None
        writer_class = RawWriter if raw else WavWriter
        with writer_class(sink, rate, 1, sample_format.value, num_frames=length) as writer:
            decode_stream(mimi, chunks, lambda pcm: writer.write(resampler.process(pcm)),
                          num_samples=num_samples)
            writer.write(resampler.flush())
