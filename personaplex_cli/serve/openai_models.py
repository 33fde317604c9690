"""The model names `serve` answers to on OpenAI's routes (`GET /v1/models` lists them,
`/v1/realtime?model=` and `/v1/chat/completions`'s `model` are checked against them).

One engine is served, whatever its checkpoint: its id is the name of NVIDIA's release (the
last part of model.files.DEFAULT_MODEL), and the alias is the project's name, for clients
that ask for "personaplex" without a version.
"""

from __future__ import annotations

from ..model.files import DEFAULT_MODEL

MODEL_ID = DEFAULT_MODEL.rsplit("/", 1)[-1]  # personaplex-7b-v1
ALIASES = ("personaplex",)
MODEL_IDS = (MODEL_ID, *ALIASES)
OWNER = DEFAULT_MODEL.split("/", 1)[0]


def is_served(name: str) -> bool:
    return name in MODEL_IDS


def unknown_model(name: str) -> str:
    return (f"the model {name[:60]!r} is not served here: ask for "
            f"{' or '.join(repr(n) for n in MODEL_IDS)} (GET /v1/models)")


def model_list(created: int) -> dict:
    """`GET /v1/models`'s answer: the id, then its aliases."""
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": OWNER}
                     for name in MODEL_IDS]}
