"""Writes a random-weight PersonaPlex model folder at the real dimensions, for measuring.

The LM (dim 4096, 32 layers, 16 depformer steps: 8.37 B parameters, 16.7 GB in bf16) goes
into `model.safetensors` in the published key layout (the depformer's per-step attention
weights fused step-major into `self_attn.in_proj_weight` / `out_proj.weight`, as NVIDIA's
file holds them), written tensor by tensor: the header first, then each tensor's bytes as it
is drawn, so the model is never in memory whole. Beside it: a full-size fp32 Mimi under the
hub's file name, a 32000-piece SentencePiece tokenizer (the LM's text card), and a random
`voices/NATF2.pt`, the default voice, so `personaplex reply --model DIR` takes the folder
as it is.

Weights are uniform with the variance of 1/fan-in (norm gains 1), so activations keep a
sane scale through the 32 layers; the text they produce is noise, the sizes and the work
per frame are the real ones.

Run: python bench/full_size.py DIR [--seed N]     (about 17 GB of disk, a few minutes)
Needs only this package and its dependencies.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import struct
import time
from pathlib import Path

import torch

from personaplex_cli.core.config import Arch
from personaplex_cli.core.lm import LMModel
from personaplex_cli.core.mimi import Mimi
from personaplex_cli.model.files import LM_FILE, MIMI_FILE, TOKENIZER_FILE, VOICES_DIR
from personaplex_cli.model.tokenizer import SYSTEM_TAG  # noqa: E402
from personaplex_cli.prompts.persona import DEFAULT_ROLE
from personaplex_cli.prompts.voices import DEFAULT_VOICE

CHUNK = 1 << 24  # values drawn at a time: 32 MB of bf16, whatever the tensor's size


def published_layout(lm: LMModel) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(published key, the shapes of our tensors stacked row-wise into it), in file order.

    Our depformer keeps one projection per step (`in_projs.S.weight`); the published file
    fuses them: `self_attn.in_proj_weight` holds steps 0..15 one after another."""
    layout: dict[str, list[tuple[int, ...]]] = {}
    for key, tensor in lm.state_dict().items():
        shape = tuple(tensor.shape)
        parts = key.split(".")
        if key.startswith("depformer.") and parts[-3] in ("in_projs", "out_projs"):
            fused = "in_proj_weight" if parts[-3] == "in_projs" else "out_proj.weight"
            layout.setdefault(".".join(parts[:-3] + [fused]), []).append(shape)
        elif key.endswith("self_attn.in_proj.weight"):
            layout[key.replace("in_proj.weight", "in_proj_weight")] = [shape]
        else:
            layout[key] = [shape]
    return list(layout.items())


def draw(shape: tuple[int, ...], key: str, generator: torch.Generator) -> torch.Tensor:
    """One tensor of our layout, in bf16: norm gains 1, everything else uniform at 1/fan-in."""
    if key.endswith("alpha"):
        return torch.ones(shape, dtype=torch.bfloat16)
    fan_in = shape[-1]
    bound = math.sqrt(3.0 / fan_in)  # uniform(-b, b) has variance b^2 / 3
    return torch.empty(shape).uniform_(-bound, bound, generator=generator).to(torch.bfloat16)


def write_lm(path: Path, seed: int) -> int:
    """The LM checkpoint, tensor by tensor -> bytes written."""
    arch = Arch()
    with torch.device("meta"):
        lm = LMModel(arch.lm)  # all 16 depformer steps, as the published file holds them
    layout = published_layout(lm)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shapes in layout:
        rows = sum(s[0] for s in shapes)
        shape = [rows, *shapes[0][1:]]
        size = 2 * math.prod(shape)
        header[key] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    generator = torch.Generator().manual_seed(seed)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, shapes in layout:
            for shape in shapes:
                rows_per_chunk = max(1, CHUNK // math.prod(shape[1:]))
                for start in range(0, shape[0], rows_per_chunk):
                    part = (min(rows_per_chunk, shape[0] - start), *shape[1:])
                    f.write(draw(part, key, generator).view(torch.uint8).numpy().data)
    os.replace(tmp, path)
    return 8 + len(blob) + offset


@torch.no_grad()
def write_mimi(path: Path, seed: int) -> None:
    """A full-size Mimi in fp32 with random weights (under our key names, which the
    loader takes as they are) and random codebooks."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    mimi = Mimi(Arch().mimi)
    state = mimi.state_dict()
    for key, tensor in state.items():
        if key.endswith("embedding_sum"):
            tensor.normal_(0.0, 0.1)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def write_tokenizer(path: Path, pieces: int, seed: int) -> None:
    """A SentencePiece word model of exactly `pieces` pieces, ids 0..3 as PersonaPlex's
    (0 and 3 are the text stream's EPAD and PAD), trained on made-up words plus the role
    prompt's, so the default prompt encodes to real pieces."""
    import sentencepiece as spm

    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < pieces + pieces // 4:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))))
    ordered = sorted(words)

    def sentences():
        yield f"{SYSTEM_TAG} {DEFAULT_ROLE} {SYSTEM_TAG}"
        for start in range(0, len(ordered), 12):
            yield " ".join(ordered[start:start + 12])

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(), model_writer=model, vocab_size=pieces,
        model_type="word", unk_id=0, bos_id=1, eos_id=2, pad_id=3, hard_vocab_limit=True,
        character_coverage=1.0, minloglevel=2)
    path.write_bytes(model.getvalue())


def write_voice(path: Path, seed: int) -> None:
    """A random voice in NVIDIA's .pt layout: 50 stored input embeddings and a token ring."""
    arch = Arch().lm
    generator = torch.Generator().manual_seed(seed)
    embeddings = (torch.randn(50, 1, 1, arch["dim"], generator=generator)).to(torch.bfloat16)
    cache = torch.randint(0, arch["card"], (1, arch["n_q"] + 1, 4), generator=generator)
    cache[:, 0] = 3  # the text stream is PAD through a voice prompt
    torch.save({"embeddings": embeddings, "cache": cache}, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder: Path = args.folder
    (folder / VOICES_DIR).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    write_tokenizer(folder / TOKENIZER_FILE, Arch().lm["text_card"], args.seed)
    write_voice(folder / VOICES_DIR / f"{DEFAULT_VOICE}.pt", args.seed)
    write_mimi(folder / MIMI_FILE, args.seed)
    print(f"tokenizer, voice and Mimi written in {time.monotonic() - started:.0f} s")
    size = write_lm(folder / LM_FILE, args.seed)
    print(f"{folder / LM_FILE}: {size / 1e9:.2f} GB, written in "
          f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
