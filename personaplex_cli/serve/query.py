"""What a caller asks for, from the query string of `/api/chat` (and `/api/reply`).

NVIDIA's web client sends `voice_prompt`, `text_prompt`, `text_temperature`, `text_topk`,
`audio_temperature`, `audio_topk`, `pad_mult`, `text_seed`, `audio_seed`,
`repetition_penalty_context`, `repetition_penalty` (and `worker_auth_id`, `email`);
Kyutai's client sends nothing. A parameter left out takes the server's default (its
`--voice`, `--prompt`, sampling options and `--seed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ..core.config import MAX_SEED, Sampling
from ..errors import InputError

# name -> what it does (docs/serving.md and the man page list these).
HONOURED = {
    "voice_prompt": "a voice by name, NATF2 or NATF2.pt: a packaged or user voice, never a path",
    "text_prompt": "the role prompt ('' for none)",
    "text_temperature": "temperature of the text",
    "text_topk": "top-k of the text",
    "audio_temperature": "temperature of the audio codes",
    "audio_topk": "top-k of the audio codes",
    "text_seed": "seeds the conversation (one generator draws text and audio)",
    "seed": "the same as text_seed",
    "greedy": "1: always the most likely token",
    "stats": "1: a 0x04 message with the session's figures every second",
    "token": "the access token, when the server has one",
}
# Sent by NVIDIA's client, accepted and ignored: what they set does not exist in this engine
# (one generator per conversation; no repetition penalty, no pad multiplier) or is the
# client's own bookkeeping.
IGNORED = ("audio_seed", "pad_mult", "repetition_penalty", "repetition_penalty_context",
           "worker_auth_id", "email")

MAX_QUERY_BYTES = 12 * 1024  # below the HTTP layer's 16 KiB limit on a request's head
MAX_TEMPERATURE = 100.0


class QueryError(InputError):
    """A query parameter the server cannot take (the 0x05 text, then close 1008)."""


@dataclass(frozen=True)
class Defaults:
    """The server's persona and sampling, for what a caller leaves out."""

    voice: str  # a --voice value ('' for none)
    role: str
    temp_text: float = Sampling.temp_text
    top_k_text: int = Sampling.top_k_text
    temp_audio: float = Sampling.temp_audio
    top_k_audio: int = Sampling.top_k_audio
    greedy: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class CallRequest:
    voice: str | None  # a voice name; None: the server's default voice
    role: str
    temp_text: float
    top_k_text: int
    temp_audio: float
    top_k_audio: int
    greedy: bool
    seed: int | None
    stats: bool
    unknown: tuple[str, ...]  # parameters neither honoured nor known to be ignored


def _number(query: Mapping[str, str], name: str, default, kind, low, high):
    if name not in query:
        return default
    raw = query[name]
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or (isinstance(value, float) and not math.isfinite(value)) \
            or not low <= value <= high:
        raise QueryError(f"{name} must be {'an integer' if kind is int else 'a number'} "
                         f"from {low} to {high}, not {raw[:40]!r}")
    return value


def _flag(query: Mapping[str, str], name: str, default: bool) -> bool:
    if name not in query:
        return default
    value = query[name].lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise QueryError(f"{name} must be 1 or 0, not {query[name][:40]!r}")


def voice_name(value: str) -> str:
    """`voice_prompt` -> a voice name; a path of any kind is refused."""
    name = value[:-3] if value.lower().endswith(".pt") else value
    from ..prompts.voices import NAME_RE

    if not NAME_RE.match(name) or name.lower().endswith(".wav"):
        raise QueryError(f"voice_prompt names a voice (like NATF2.pt), not a file: "
                         f"{value[:60]!r}")
    return name


def parse_call(query: Mapping[str, str], defaults: Defaults, query_bytes: int) -> CallRequest:
    if query_bytes > MAX_QUERY_BYTES:
        raise QueryError(f"the query is {query_bytes} bytes, over the limit of "
                         f"{MAX_QUERY_BYTES}")
    voice = query.get("voice_prompt")
    seed_key = "text_seed" if "text_seed" in query else "seed"
    role = query.get("text_prompt", defaults.role)
    from ..model.tokenizer import not_utf8

    problem = not_utf8(role, "text_prompt")
    if problem is not None:
        raise QueryError(problem)
    return CallRequest(
        voice=voice_name(voice) if voice else None,
        role=role,
        temp_text=_number(query, "text_temperature", defaults.temp_text, float, 0.0,
                          MAX_TEMPERATURE),
        top_k_text=_number(query, "text_topk", defaults.top_k_text, int, 0, 1_000_000),
        temp_audio=_number(query, "audio_temperature", defaults.temp_audio, float, 0.0,
                           MAX_TEMPERATURE),
        top_k_audio=_number(query, "audio_topk", defaults.top_k_audio, int, 0, 1_000_000),
        greedy=_flag(query, "greedy", defaults.greedy),
        seed=_number(query, seed_key, None, int, 0, MAX_SEED),  # None: the switchboard decides
        stats=_flag(query, "stats", False),
        unknown=tuple(sorted(k for k in query if k not in HONOURED and k not in IGNORED)),
    )

