"""The served model's names in OpenAI's APIs: what `GET /v1/models` lists and what a
request's `model` (or `/v1/realtime?model=`) must be.

The first id is the model's own name: the Hugging Face repo's name when it was opened from
the hub (`nvidia/personaplex-7b-v1` -> `personaplex-7b-v1`), else the published model's
name (a folder holds PersonaPlex weights under some local name that means nothing to a
client). `personaplex` is an alias for it, so a client need not know which one is served.
"""

from __future__ import annotations

ALIAS = "personaplex"
OWNER = "personaplex"


def served_ids(files) -> tuple[str, ...]:
    """(the model's id, its alias) for a model.files.ModelDir."""
    from ..model.files import DEFAULT_MODEL

    repo = files.name if getattr(files, "hub", False) else DEFAULT_MODEL
    own = repo.rstrip("/").rsplit("/", 1)[-1]
    return (own,) if own == ALIAS else (own, ALIAS)


def is_served(name: str | None, ids: tuple[str, ...]) -> bool:
    """Whether a request's model names this server's; a request may leave it out."""
    return name is None or name in ids


def model_list(ids: tuple[str, ...], created: int) -> dict:
    """`GET /v1/models`'s answer."""
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": OWNER}
                     for name in ids]}


def unknown_model(name: object, ids: tuple[str, ...]) -> str:
    shown = str(name)[:80]
    return (f"the model {shown!r} is not served here: GET /v1/models lists "
            f"{' and '.join(repr(i) for i in ids)}")
