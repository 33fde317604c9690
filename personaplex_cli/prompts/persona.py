"""Who the assistant is: a voice and a role, made ready for one model.

A `Persona` is what a user names (a voice, a role text); `prepare_persona` reads the voice,
tokenizes the role and checks both against the model's architecture before any weight is
loaded, so a bad persona fails before the wait; the result, a `PersonaPrompt`, is what the
runtime primes a row with (core.priming.PersonaTokens, once the voice recording is coded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

import numpy as np
import torch

from ..core.config import FRAME_RATE, FRAME_SIZE, SAMPLE_RATE
from ..core.priming import SILENCE_FRAMES, PersonaTokens, VoiceEmbeddings, priming_steps
from ..core.session import encode_voice, record_voice_phase
from ..errors import InputError
from ..model.tokenizer import DEFAULT_ROLE
from .voices import Voice

if TYPE_CHECKING:
    from ..model.model import Model

@dataclass(frozen=True)
class Persona:
    """Who the assistant is: a voice (None: no voice prompt at all) and a role text (None:
    no role prompt at all, as NVIDIA's server reads an empty `text_prompt`)."""

    voice: Voice | None
    role: str | None = DEFAULT_ROLE


@dataclass
class PersonaPrompt:
    """A persona made ready for one model: the voice as a 24 kHz recording or as a .pt's
    stored embeddings, and the role prompt as tokens. `key` names it in the runtime's cache
    of primed personas (None: never cached)."""

    text_tokens: list[int]
    voice_pcm: torch.Tensor | None = None
    voice_embeddings: VoiceEmbeddings | None = None
    key: Hashable | None = None
    voice_name: str | None = None  # for the logs
    _tokens: PersonaTokens | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of_tokens(cls, tokens: PersonaTokens, key: Hashable | None = None) -> PersonaPrompt:
        """A persona given as its priming tokens already (doctor's seeded check: no voice
        file, no tokenizer)."""
        return cls(list(tokens.text_tokens), key=key, _tokens=tokens)

    def persona_tokens(self, model: Model) -> PersonaTokens:
        """What a row is primed with (the voice recording's Mimi codes computed once)."""
        if self._tokens is None:
            codes = None if self.voice_pcm is None else encode_voice(model.mimi, self.voice_pcm)
            self._tokens = PersonaTokens(tuple(self.text_tokens), codes, self.voice_embeddings)
        return self._tokens

    @property
    def frames(self) -> int:
        """Frames the priming takes: voice, silence, role prompt, silence."""
        voice_steps = 0
        if self.voice_embeddings is not None:
            voice_steps = len(self.voice_embeddings.embeddings)
        elif self.voice_pcm is not None:
            voice_steps = -(-len(self.voice_pcm) // FRAME_SIZE)
        return priming_steps(voice_steps, len(self.text_tokens))


def prepare_persona(model: Model, persona: Persona) -> PersonaPrompt:
    """Reads the voice, tokenizes the role, and checks both against this model's
    architecture (no weights are loaded)."""
    from .voice import check_voice, load_voice_pt, read_voice_audio

    lm = model.arch.lm
    context = lm["context"]
    prompt = PersonaPrompt([] if persona.role is None
                           else model.tokenizer.role_prompt(persona.role))
    if len(prompt.text_tokens) + 2 * SILENCE_FRAMES > context:
        raise InputError(f"the role prompt is {len(prompt.text_tokens)} tokens; with its "
                         f"silences it needs more than the model's context of {context} "
                         f"frames ({context / FRAME_RATE:.0f} s): shorten it")
    voice = persona.voice
    if voice is None:
        prompt.key = (None, tuple(prompt.text_tokens))
        return prompt
    prompt.voice_name = voice.name
    stat = voice.path.stat()
    prompt.key = (str(voice.path.resolve()), stat.st_size, stat.st_mtime_ns,
                  tuple(prompt.text_tokens))
    if voice.kind == "pt":
        stored = load_voice_pt(voice.path)
        check_voice(voice.path, stored, lm)
        prompt.voice_embeddings = VoiceEmbeddings(stored.embeddings.to(model.dtype),
                                                  stored.cache)
    else:
        prompt.voice_pcm = torch.from_numpy(read_voice_audio(str(voice.path), SAMPLE_RATE))
    return prompt


def record_voice(model: Model, recording: np.ndarray) -> VoiceEmbeddings:
    """The voice phase of a normalised 24 kHz recording, as a .pt voice stores it."""
    return record_voice_phase(model.mimi, model.lm, torch.from_numpy(recording))
