"""The personas a run asks for, each prepared once (its voice read, its role tokenized and
both checked against the model) and kept, so that every row of a persona shares one
prompts.persona.PersonaPrompt, whose key names its primed state in runtime/priming.py.

The one cache of prepared personas for every command: reply's jobs, serve's callers, talk.
Past PERSONAS_CACHED the least recently used goes (a server's callers may ask for any
number of voices and roles); it is prepared again if asked for again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from ..core.config import PERSONAS_CACHED


class Personas:
    """`prompt(voice, role)` for one model. `find(voice)` -> a prompts.voices.Voice (or
    None for no voice) decides what a voice value may name: by default `--voice`'s rule
    (a packaged name or a file, '' for none); a server's callers name packaged voices
    only."""

    def __init__(self, model, find: Callable | None = None, cached: int = PERSONAS_CACHED):
        self.model = model
        self._find = find
        self._cached = cached
        self._prompts: OrderedDict = OrderedDict()
        self._asked: set = set()
        self._lock = threading.Lock()  # a server prepares on several threads at once

    def prompt(self, voice, role: str | None):
        """The prepared persona of `voice` (as `find` takes it) and `role` (None: no role
        prompt at all)."""
        kept = self.kept(voice, role)
        if kept is not None:
            return kept
        from ..prompts.persona import Persona, prepare_persona

        prompt = prepare_persona(self.model, Persona(self.find(voice), role))
        with self._lock:
            self._prompts[(voice, role)] = prompt
            while len(self._prompts) > self._cached:
                self._prompts.popitem(last=False)
        return prompt

    def kept(self, voice, role: str | None):
        """The prepared persona if it is kept, else None (nothing is read)."""
        with self._lock:
            self._asked.add((voice, role))
            prompt = self._prompts.get((voice, role))
            if prompt is not None:
                self._prompts.move_to_end((voice, role))
            return prompt

    def find(self, voice):
        if self._find is not None:
            return self._find(voice)
        from ..prompts.voices import find_voice

        files = self.model.files
        return find_voice(voice, files.voices_dir(), files.voices_hint())

    def voice_file(self, voice: str) -> str:
        """The file a --voice value stands for ('' for none), by its absolute path."""
        found = self.find(voice)
        return "" if found is None else str(found.path.resolve())

    def __len__(self) -> int:
        """The personas asked for so far (kept or not)."""
        return len(self._asked)
