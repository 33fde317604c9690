"""What quantization costs in output: the LM quantized against itself unquantized (or
against another quantization: --reference int8-weights compares int8's activation rows to
the weight-only int8 it replaced).

Greedy, with the same caller codes (random, seeded) on both, per frame:
  teacher-forced  the quantized LM is fed exactly the reference's inputs at every call (the
                  temporal transformer's input embedding, each depformer step's previous
                  token), so its logits answer the same question as the reference's: the
                  cosine and the largest error of the text and audio logits (relative to the
                  reference's largest logit), and how often its greedy token is the same;
  free-running    the quantized LM on its own: the share of frames whose text token and
                  audio codes equal the reference's, and the first frame that differs.
The two models are loaded one after the other (never both at once), so a real-size
checkpoint needs the memory of one.

Run: python bench/quantize_quality.py [DIR] [--frames 200] [--dtype fp32|bf16]
     [--quantize int8|int8-weights|int4|fp8] [--reference none|int8-weights|...]
     (DIR: a model folder; default: the golden tiny checkpoints)
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from personaplex_cli.core.config import QUANTIZE_MODES
from personaplex_cli.core.generator import FrameGenerator
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.load import load_lm
from personaplex_cli.model.device import DTYPES

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "data" / "golden" / "assets"


class Recorder:
    """Wraps one LM's two per-frame calls: records what they got and gave, and (when given
    a reference Recorder) feeds them the reference's inputs instead of their own."""

    def __init__(self, lm, follow: "Recorder | None" = None):
        self.follow = follow  # (no reference to lm: it must be freed before the next loads)
        self.inputs: list[torch.Tensor] = []  # temporal input embeddings, per frame
        self.prev: list[torch.Tensor] = []  # depformer previous tokens, per call
        self.text: list[torch.Tensor] = []  # text logits, per frame
        self.audio: list[torch.Tensor] = []  # depformer logits, per call
        # the class's own methods: a second Recorder on the same LM replaces the first
        forward = type(lm).forward_embeddings.__get__(lm)
        depformer = type(lm).depformer_step.__get__(lm)

        def forward_embeddings(x, state):
            if self.follow is not None:
                x = self.follow.inputs[len(self.inputs)]
            self.inputs.append(x)
            out, logits = forward(x, state)
            self.text.append(logits.float())
            return out, logits

        def depformer_step(step, prev_token, *rest):
            if self.follow is not None:
                prev_token = self.follow.prev[len(self.prev)]
            self.prev.append(prev_token)
            logits = depformer(step, prev_token, *rest)
            self.audio.append(logits.float())
            return logits

        lm.forward_embeddings = forward_embeddings
        lm.depformer_step = depformer_step


def run(lm, user: torch.Tensor, follow: Recorder | None = None, what: str = ""
        ) -> tuple[Recorder, list[torch.Tensor]]:
    recorder = Recorder(lm, follow)
    gen = FrameGenerator(lm)
    gen.set_sampling(0, Sampling(greedy=True), torch.Generator().manual_seed(0))
    frames = []
    cpu, wall = time.process_time(), time.perf_counter()
    for codes in user:
        frame = gen.step(user=codes[None])
        if frame is not None:
            frames.append(frame[0])
    if what:  # CPU time is what a busy machine does not inflate
        print(f"  {what}: {(time.process_time() - cpu) / len(user):.2f} CPU s and "
              f"{(time.perf_counter() - wall) / len(user):.2f} s per LM step")
    return recorder, frames


def compare(name: str, ref: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    a, b = torch.stack(ref).flatten(1), torch.stack(got).flatten(1)
    cos = F.cosine_similarity(a, b, dim=1)
    error = (a - b).abs().amax() / a.abs().amax()
    agree = (a.argmax(dim=1) == b.argmax(dim=1)).float().mean()
    print(f"  {name:6} logits cosine mean {cos.mean():.6f}, min {cos.min():.6f}; largest "
          f"error {100 * error:.2f}% of the largest logit; greedy token agrees "
          f"{100 * agree:.1f}% of {len(ref)} calls")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?")
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--quantize", default="int8", choices=QUANTIZE_MODES[1:])
    parser.add_argument("--reference", default="none", choices=QUANTIZE_MODES,
                        help="what the quantized LM is compared against (default: unquantized)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder
        if folder is None:  # the golden tiny checkpoints, with their small architecture
            folder = Path(tmp)
            for name in ("model.safetensors", "tokenizer-tiny-mimi.safetensors"):
                (folder / name).symlink_to(GOLDEN / name)
            shutil.copy(GOLDEN / "personaplex-arch.json", folder / "personaplex-arch.json")
        files = ModelDir(folder, str(folder))
        cpu = torch.device("cpu")
        generator = torch.Generator().manual_seed(args.seed)
        lm = load_lm(files, cpu, dtype, quantize=args.reference)
        user = torch.randint(0, lm.card, (args.frames, lm.n_q // 2), generator=generator)
        print(f"{args.folder or 'golden tiny checkpoints'}: {args.dtype}, {args.quantize} vs "
              f"{args.reference}, {args.frames} frames, greedy, random caller codes (seed "
              f"{args.seed}), {torch.get_num_threads()} threads")
        reference, ref_frames = run(lm, user, what=f"{args.dtype}, {args.reference}")
        freed = weakref.ref(lm)
        del lm
        gc.collect()
        if freed() is not None:  # both 7Bs at once would not fit: stop rather than swap
            raise SystemExit("the unquantized LM is still referenced; not loading another")
        started = time.perf_counter()
        quantized = load_lm(files, cpu, dtype, quantize=args.quantize)
        print(f"  loaded and quantized in {time.perf_counter() - started:.0f} s")
        forced, _ = run(quantized, user, follow=reference)
        print("teacher-forced (same inputs at every call):")
        compare("text", reference.text, forced.text)
        compare("audio", reference.audio, forced.audio)
        _, frames = run(quantized, user, what=f"{args.dtype}, {args.quantize}")
    ref_tokens, tokens = torch.stack(ref_frames), torch.stack(frames)
    text = (ref_tokens[:, 0] == tokens[:, 0]).float().mean()
    audio = (ref_tokens[:, 1:9] == tokens[:, 1:9]).all(dim=1).float().mean()
    same = (ref_tokens[:, :9] == tokens[:, :9]).all(dim=1)
    first = int((~same).nonzero()[0]) if not same.all() else None
    print(f"free-running: text token the same in {100 * text:.1f}% of {len(tokens)} frames, "
          f"all 8 audio codes in {100 * audio:.1f}%; first frame that differs: "
          f"{'none' if first is None else first}")


if __name__ == "__main__":
    main()
