"""Writes a random-weight PersonaPlex model folder at the real dimensions, for measuring.

The LM (dim 4096, 32 layers, 16 depformer steps: 8.37 B parameters, 16.7 GB in bf16) goes
into `model.safetensors` in the published key layout, written tensor by tensor, so the model
is never in memory whole; beside it a full-size fp32 Mimi, a 32000-piece SentencePiece
tokenizer and the 18 packaged voices (voices.tgz, unpacked into voices/), all under the hub's
names, so `personaplex reply --model DIR` takes the folder as it is. The writer is the one
`personaplex download --tiny` uses (personaplex_cli/model/random_model.py), at the real
dimensions: the text it produces is noise, the sizes and the work per frame are the real ones.

Run: python bench/full_size.py DIR [--seed N]     (about 17 GB of disk, a few minutes)
Needs only this package and its dependencies.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from personaplex_cli.core.config import Arch
from personaplex_cli.model.files import LM_FILE
from personaplex_cli.model.random_model import write_model_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder: Path = args.folder
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"{message} in {time.monotonic() - started:.0f} s")

    size = write_model_files(folder, Arch(), args.seed, real_size=True, say=say)
    print(f"{folder / LM_FILE}: {(folder / LM_FILE).stat().st_size / 1e9:.2f} GB; "
          f"{size / 1e9:.2f} GB in all, written in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
