"""A server made ready: the model loaded, the default persona checked, the engine's slots
warmed up, the switchboard and the app built. `personaplex serve` opens one and runs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .access import Access
from .query import Defaults

MOST_SESSIONS = 64  # never more by default, nor more than the warm-up holds in real time


@dataclass
class Server:
    switchboard: object  # serve.switchboard.Switchboard
    app: object  # the Starlette app
    capacity: object  # runtime.warmup.Capacity
    device: str

    @classmethod
    def open(cls, model_spec: str | None, device: str, dtype: str | None, defaults: Defaults,
             access: Access, *, max_sessions: int | None, idle_timeout: float,
             static_dir: Path | None, log: Callable[[str], None],
             debug: Callable[[str], None], quantize: str = "none",
             threads: int | None = None, max_prime_s: float = 0.0) -> Server:
        """`threads`: torch's thread count as a deployment set it (else the warm-up's).
        `max_prime_s`: the most priming a caller's role prompt may take (0: no limit), at
        the warm-up's cost per frame; the server's own persona is held to it too."""
        from ..conversation import ConversationBatch
        from ..prompts.persona import Persona, prepare_persona
        from ..core.sampling import Sampling
        from ..model.model import Model
        from ..prompts.voices import find_voice
        from .app import build_app
        from ..errors import InputError
        from ..runtime.limits import role_prompt_refusal
        from ..runtime.warmup import ThreadsMemory, settle, warm_up_slots
        from .switchboard import Switchboard

        model = Model.open(model_spec, device, dtype, quantize)
        debug(f"model: {model.path}; device: {model.device}, "
              f"{str(model.dtype).removeprefix('torch.')}, {quantize} quantization")
        # Before any weight loads: the sessions asked for must fit, or by default as many
        # as the device's free memory holds (at least one, which must fit too). The
        # warm-up then keeps, by default, no more than keep real time.
        fits = min(MOST_SESSIONS, max(1, model.sessions_that_fit() or 1))
        need = model.preflight(max_sessions or fits, "--max-sessions")
        debug(f"memory: about {need.total / 2**30:.1f} GiB for {max_sessions or fits} "
              f"sessions ({need})")
        voices_dir = model.files.voices_dir()
        # The server's own persona must work before any caller asks for it.
        prompt = prepare_persona(model, Persona(find_voice(defaults.voice, voices_dir,
                                                           model.files.voices_hint()),
                                                defaults.role))
        slots = ConversationBatch(model, max_sessions or fits)
        capacity = warm_up_slots(slots, prompt, Sampling(), model.device.type,
                                 fits_memory=fits, asked=max_sessions, threads=threads,
                                 memory=ThreadsMemory.of_model(model))
        debug(f"warm-up: priming {capacity.prime_ms:.1f} ms per frame")
        refusal = role_prompt_refusal(len(prompt.text_tokens), capacity.prime_ms / 1000.0,
                                      max_prime_s)
        if refusal is not None:
            raise InputError(f"--prompt: {refusal}")
        if capacity.rows < slots.capacity:  # fewer rows than memory holds: give it back
            slots = ConversationBatch(model, capacity.rows)
            settle(slots, prompt, Sampling())
        switchboard = Switchboard(model, slots, defaults, access, idle_timeout=idle_timeout,
                                  log=log, debug=debug,
                                  prime_cost_s=capacity.prime_ms / 1000.0,
                                  max_prime_s=max_prime_s, voices_dir=voices_dir)
        return cls(switchboard, build_app(switchboard, static_dir), capacity,
                   model.device.type)

    def run(self, sock, *, ssl_cert: str | None = None, ssl_key: str | None = None,
            on_ready: Callable[[Callable[[], None]], None], handle_signals: bool = True
            ) -> int | None:
        """Serves on `sock` until a signal (-> its number), an engine failure (-> None) or
        the `stop` that on_ready(stop) gets is called."""
        from .runner import serve

        return serve(self.switchboard, self.app, sock, ssl_cert=ssl_cert, ssl_key=ssl_key,
                     on_ready=on_ready, handle_signals=handle_signals)
