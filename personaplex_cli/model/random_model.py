"""Random-weight PersonaPlex models, written as the hub's files: `personaplex download --tiny`'s
tiny one, and bench/full_size.py's at the real dimensions.

The folder holds what `personaplex download` leaves in the hub cache, under the same names:

  model.safetensors                              the LM, bf16, in the published key layout
  tokenizer-e351c8d8-checkpoint125.safetensors   Mimi, fp32
  tokenizer_spm_32k_3.model                      a SentencePiece model of text_card pieces
  voices.tgz, voices/                            the 18 packaged voices, NVIDIA's names
  personaplex-arch.json                          the dimensions, when not the real ones

Weights are uniform with the variance of 1/fan-in (norm gains 1), so activations keep a sane
scale through the layers: the work per frame is the real work at these dimensions, and what
the model says is noise. The LM's safetensors metadata records the seed
(files.RANDOM_WEIGHTS_KEY), which is how `doctor` tells such a model from a trained one.
Everything is drawn from `seed`: the same seed writes the same bytes.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import random
import shutil
import struct
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core.config import Arch
from ..core.lm import LMModel
from ..core.mimi import Mimi
from ..errors import DiskFullError, OutputError
from .files import (ARCH_FILE, LM_FILE, MIMI_FILE, PACKAGED, RANDOM_WEIGHTS_KEY,
                    TOKENIZER_FILE, VOICES_ARCHIVE, VOICES_DIR, random_weights_seed,
                    tiny_model_dir)
from .skeleton import shapes_only
from .tokenizer import DEFAULT_ROLE, SYSTEM_TAG
from .voices_archive import extract_voices, remove_stale_temporaries

# The golden tiny checkpoints' dimensions (tests/data/golden/assets/personaplex-arch.json):
# a 64-frame (5 s) window, so a conversation's window slides within seconds.
TINY_LM = dict(dim=64, num_heads=4, num_layers=2, text_card=512, context=64, depformer_dim=32,
               depformer_num_heads=4, depformer_num_layers=2, depformer_dim_feedforward=132)
TINY_MIMI = dict(seanet=dict(dimension=32, n_filters=4),
                 transformer=dict(d_model=32, num_heads=4, num_layers=2, dim_feedforward=64,
                                  context=40, input_dimension=32, output_dimensions=[32]),
                 quantizer=dict(dimension=16, input_dimension=32, output_dimension=32))
TINY_SEED = 0
VOICE_FRAMES = 50  # stored input embeddings per voice, as NVIDIA's (about 4 s of speech)
CHUNK = 1 << 24  # values drawn at a time: 32 MB of bf16, whatever the tensor's size


def tiny_arch() -> Arch:
    arch = Arch()
    arch.lm.update(TINY_LM)
    for group, values in TINY_MIMI.items():
        getattr(arch.mimi, group).update(values)
    return arch


# -- the weights ---------------------------------------------------------------------------------

@torch.no_grad()
def random_init(module: torch.nn.Module, generator: torch.Generator | None = None) -> None:
    """Weights with the variance of 1 / fan-in (norm gains 1), so activations keep a sane
    scale through the layers; Mimi's codebooks get small random entries."""
    for name, p in module.named_parameters():
        if name.endswith(("alpha", "norm1.weight", "norm2.weight")):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, (p.numel() / p.shape[0]) ** -0.5, generator=generator)
        else:
            p.normal_(0.0, 0.02, generator=generator)
    for name, buffer in module.named_buffers():
        if name.endswith("embedding_sum"):
            buffer.normal_(0.0, 0.1, generator=generator)


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
    bound = math.sqrt(3.0 / shape[-1])  # uniform(-b, b) has variance b^2 / 3
    return torch.empty(shape).uniform_(-bound, bound, generator=generator).to(torch.bfloat16)


def write_lm(path: Path, lm_arch: dict, seed: int) -> int:
    """The LM checkpoint, tensor by tensor (the header first, then each tensor's bytes as it
    is drawn, so a 7B is never in memory whole) -> bytes written."""
    with shapes_only():  # only the shapes are wanted
        lm = LMModel(lm_arch)  # every depformer step, as the published file holds them
    layout = published_layout(lm)
    metadata = {"format": "pt", RANDOM_WEIGHTS_KEY: str(seed)}
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key, shapes in layout:
        shape = [sum(s[0] for s in shapes), *shapes[0][1:]]
        size = 2 * math.prod(shape)
        header[key] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    generator = torch.Generator().manual_seed(seed)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, shapes in layout:
            for shape in shapes:
                rows_per_chunk = max(1, CHUNK // math.prod(shape[1:]))
                for start in range(0, shape[0], rows_per_chunk):
                    part = (min(rows_per_chunk, shape[0] - start), *shape[1:])
                    f.write(draw(part, key, generator).view(torch.uint8).numpy().data)
    os.replace(partial, path)
    return 8 + len(blob) + offset


@torch.no_grad()
def write_mimi(path: Path, arch: Arch, seed: int) -> None:
    """Mimi in fp32 under our key names (which the loader takes as they are)."""
    from safetensors.torch import save_file

    mimi = Mimi(arch.mimi)
    random_init(mimi, torch.Generator().manual_seed(seed))
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(path))
    path.chmod(0o644 & ~_umask())  # safetensors writes through a private temporary file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_tokenizer(path: Path, pieces: int, seed: int) -> None:
    """A SentencePiece word model of exactly `pieces` pieces, ids 0..3 as PersonaPlex's
    (0 and 3 are the text stream's EPAD and PAD), trained on made-up words and the default
    role prompt's, so that prompt encodes to real pieces."""
    import sentencepiece as spm

    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < pieces + pieces // 4:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))))
    ordered = sorted(words)

    def sentences():
        for _ in range(8):  # frequent enough to be kept whatever the vocabulary's size
            yield f"{SYSTEM_TAG} {DEFAULT_ROLE} {SYSTEM_TAG}"
        for start in range(0, len(ordered), 12):
            yield " ".join(ordered[start:start + 12])

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(), model_writer=model, vocab_size=pieces,
        model_type="word", unk_id=0, bos_id=1, eos_id=2, pad_id=3, hard_vocab_limit=True,
        character_coverage=1.0, num_threads=1, minloglevel=2)
    path.write_bytes(model.getvalue())


def voice_bytes(lm_arch: dict, generator: torch.Generator) -> bytes:
    """A random voice in NVIDIA's .pt layout: stored input embeddings [E, 1, 1, dim] and the
    token ring [1, n_q + 1, 4] as the voice phase leaves it."""
    # A short window keeps room for a role prompt after the voice.
    frames = min(VOICE_FRAMES, lm_arch["context"] // 4)
    embeddings = torch.randn(frames, 1, 1, lm_arch["dim"], generator=generator)
    cache = torch.randint(0, lm_arch["card"], (1, lm_arch["n_q"] + 1, 4), generator=generator)
    cache[:, 0] = 3  # the text stream is PAD through a voice prompt
    buffer = io.BytesIO()
    torch.save({"embeddings": embeddings.to(torch.bfloat16), "cache": cache}, buffer)
    return buffer.getvalue()


def write_voices_archive(path: Path, lm_arch: dict, seed: int,
                         names: tuple[str, ...] = PACKAGED) -> None:
    """voices.tgz as the hub's: `voices/NAME.pt` for each name, the same bytes for the same
    seed (no times, owners or gzip name recorded)."""
    generator = torch.Generator().manual_seed(seed)
    with open(path, "wb") as raw:
        import gzip

        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                folder = tarfile.TarInfo(VOICES_DIR)
                folder.type, folder.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(folder)
                for name in names:
                    data = voice_bytes(lm_arch, generator)
                    member = tarfile.TarInfo(f"{VOICES_DIR}/{name}.pt")
                    member.size, member.mode = len(data), 0o644
                    tar.addfile(member, io.BytesIO(data))


def arch_overrides(arch: Arch) -> dict:
    """personaplex-arch.json's content for `arch`: every group whole."""
    mimi = {"seanet": arch.mimi.seanet, "transformer": arch.mimi.transformer,
            "quantizer": arch.mimi.quantizer, "num_codebooks": arch.mimi.num_codebooks}
    return {"mimi": mimi, "lm": arch.lm}


def write_model_files(folder: Path, arch: Arch, seed: int, *, real_size: bool = False,
                      say: Callable[[str], None] = lambda message: None) -> int:
    """Every file of a random-weight model into the existing `folder` -> bytes written.
    The voices are unpacked beside their archive, as `personaplex download` does."""
    if not real_size:
        (folder / ARCH_FILE).write_text(json.dumps(arch_overrides(arch), indent=1) + "\n")
    write_tokenizer(folder / TOKENIZER_FILE, arch.lm["text_card"], seed)
    write_voices_archive(folder / VOICES_ARCHIVE, arch.lm, seed)
    extract_voices(folder / VOICES_ARCHIVE, folder / VOICES_DIR)
    write_mimi(folder / MIMI_FILE, arch, seed)
    say("tokenizer, voices and Mimi written")
    write_lm(folder / LM_FILE, arch.lm, seed)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# -- the tiny model, in place ------------------------------------------------------------------

@dataclass(frozen=True)
class TinyModel:
    path: Path
    size: int  # bytes, every file
    seconds: float
    replaced: bool  # a tiny model was there before and was written again

    def as_json(self) -> dict:
        """`download --json`'s keys (no repo or revision: nothing came from the hub)."""
        files = [self.path / name for name in (LM_FILE, MIMI_FILE, TOKENIZER_FILE,
                                               VOICES_ARCHIVE, ARCH_FILE)]
        return {"repo": None, "revision": None, "path": str(self.path), "tiny": True,
                "files": [{"name": f.name, "size": f.stat().st_size, "path": str(f)}
                          for f in files]}


def write_tiny_model(target: Path | None = None) -> TinyModel:
    """The tiny random-weight model, written whole into `target` (default `tiny_model_dir()`):
    into a hidden folder beside it, renamed into place once complete. A tiny model already
    there is written again (the same bytes); an empty folder is taken; anything else is
    left alone (OutputError, exit 8)."""
    target = Path(target) if target is not None else tiny_model_dir()
    started = time.perf_counter()
    replaced = _check_target(target)
    parent = target.parent
    tmp: Path | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(parent, target.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=parent))
        folder = tmp / "model"
        folder.mkdir()
        size = write_model_files(folder, tiny_arch(), TINY_SEED)
        if target.exists() or target.is_symlink():
            os.rename(target, tmp / "old")  # an empty folder, or the tiny model written before
        os.rename(folder, target)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"no space left on the disk of {parent} for the tiny model "
                                f"(about 20 MB); free some space and run it again") from None
        raise OutputError(f"cannot write the tiny model into {parent}: "
                          f"{error.strerror or error}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return TinyModel(target, size, time.perf_counter() - started, replaced)


def _check_target(target: Path) -> bool:
    """Whether a tiny model is there to be replaced; OutputError when something else is."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise OutputError(f"{target} exists and is not a folder; move it away first")
    if not target.exists():
        return False
    if random_weights_seed(target / LM_FILE) is not None:
        return True
    try:
        empty = not any(target.iterdir())
    except OSError as error:
        raise OutputError(f"cannot read {target}: {error.strerror or error}") from None
    if empty:
        return False
    raise OutputError(f"{target} holds files that are not a tiny model this command wrote; "
                      "move them away first")
