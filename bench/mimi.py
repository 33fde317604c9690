"""Mimi speed: ours against Kyutai's reference (moshi 0.2.13) on the same random full-size weights.

Run: python bench/mimi.py [--frames N] [--threads T] [--seconds S]
Prints per-frame streaming encode/decode medians, ours with 25 frames per call (what the
encode and decode commands do), and whole-file encode/decode times, each with the ratio
ours / reference (lower is better; the goal for streaming is <= 0.6).
Needs the test extra and `pip install --no-deps moshi==0.2.13`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import reference  # noqa: E402

from personaplex_cli.model.load import load_mimi_from_dir  # noqa: E402


def median_ms(fn, frames: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(frames):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def once_s(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=50, help="timed streaming frames")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seconds", type=float, default=60.0, help="whole-file length")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        ref = reference.build_mimi(Path(tmp), None, seed=0)
        ours, _ = load_mimi_from_dir(Path(tmp), torch.device("cpu"))

    frame = 0.1 * torch.randn(1, 1, 1920)
    codes = ref.encode(frame)

    rows = []
    with ref.streaming(1):
        ref_enc = median_ms(lambda: ref.encode(frame), args.frames)
    enc_state = ours.encoder_state(1)
    our_enc = median_ms(lambda: ours.encode(frame, enc_state), args.frames)
    with ref.streaming(1):
        ref_dec = median_ms(lambda: ref.decode(codes), args.frames)
    dec_state = ours.decoder_state(1)
    our_dec = median_ms(lambda: ours.decode(codes, dec_state), args.frames)
    rows.append(("streaming encode, ms/frame", our_enc, ref_enc))
    rows.append(("streaming decode, ms/frame", our_dec, ref_dec))
    rows.append(("streaming encode+decode, ms/frame", our_enc + our_dec, ref_enc + ref_dec))

    # What `encode`/`decode` do with files: 25 frames per call, the same results as frame by
    # frame (the reference has no equivalent; compared with its frame-by-frame streaming).
    chunk = 25
    block = 0.1 * torch.randn(1, 1, 1920 * chunk)
    block_codes = ref.encode(block)
    enc_state = ours.encoder_state(1, max_frames=chunk)
    dec_state = ours.decoder_state(1, max_frames=chunk)
    our_chunk = (median_ms(lambda: ours.encode(block, enc_state), max(3, args.frames // chunk))
                 + median_ms(lambda: ours.decode(block_codes, dec_state),
                             max(3, args.frames // chunk))) / chunk
    rows.append((f"{chunk} frames per call, enc+dec, ms/frame", our_chunk, ref_enc + ref_dec))

    audio = 0.1 * torch.randn(1, 1, int(args.seconds * 24000))
    long_codes = ref.encode(audio)
    ref_whole_enc = once_s(lambda: ref.encode(audio))
    our_whole_enc = once_s(lambda: ours.encode(audio))
    ref_whole_dec = once_s(lambda: ref.decode(long_codes))
    our_whole_dec = once_s(lambda: ours.decode(long_codes))
    rows.append((f"whole {args.seconds:g} s encode, s", our_whole_enc, ref_whole_enc))
    rows.append((f"whole {args.seconds:g} s decode, s", our_whole_dec, ref_whole_dec))

    print(f"Mimi full size, random weights, CPU, {args.threads} threads, torch {torch.__version__}")
    print(f"{'measurement':38} {'ours':>9} {'reference':>10} {'ratio':>7}")
    for name, ours_value, ref_value in rows:
        print(f"{name:38} {ours_value:9.2f} {ref_value:10.2f} {ours_value / ref_value:7.2f}x")


if __name__ == "__main__":
    main()
