"""A server made ready: the model loaded, the default persona checked, the engine's slots
warmed up, the switchboard and the app built. `personaplex serve` opens one and runs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .access import Access
from .query import Defaults

MOST_SESSIONS = 64  # never more by default: the warm-up line says how many keep real time


@dataclass
class Server:
    switchboard: object  # serve.switchboard.Switchboard
    app: object  # the Starlette app
    warm_up: object  # serve.scheduler.WarmUp
    device: str

    @classmethod
    def open(cls, model_spec: str | None, device: str, dtype: str | None, defaults: Defaults,
             access: Access, *, max_sessions: int | None, idle_timeout: float,
             static_dir: Path | None, log: Callable[[str], None],
             debug: Callable[[str], None], quantize: str = "none") -> Server:
        from ..conversation import Persona, ConversationBatch, prepare_persona
        from ..core.sampling import Sampling
        from ..model.model import Model
        from ..prompts.voices import find_voice
        from .app import build_app
        from .scheduler import warm_up
        from .switchboard import Switchboard

        model = Model.open(model_spec, device, dtype, quantize)
        debug(f"model: {model.path}; device: {model.device}, "
              f"{str(model.dtype).removeprefix('torch.')}, {quantize} quantization")
        # Before any weight loads: the sessions asked for must fit, or by default as many
        # as the device's free memory holds (at least one, which must fit too).
        capacity = max_sessions or min(MOST_SESSIONS, max(1, model.sessions_that_fit() or 1))
        need = model.preflight(capacity, "--max-sessions")
        debug(f"memory: about {need.total / 2**30:.1f} GiB for {capacity} sessions ({need})")
        voices_dir = model.files.voices_dir()
        # The server's own persona must work before any caller asks for it.
        prompt = prepare_persona(model, Persona(find_voice(defaults.voice, voices_dir,
                                                           model.files.voices_hint()),
                                                defaults.role))
        slots = ConversationBatch(model, capacity)
        measured = warm_up(slots, prompt, Sampling(), capacity)
        debug(f"warm-up: priming {1000 * measured.prime_cost_s:.1f} ms per frame")
        switchboard = Switchboard(model, slots, defaults, access, idle_timeout=idle_timeout,
                                  log=log, debug=debug, prime_cost_s=measured.prime_cost_s,
                                  voices_dir=voices_dir)
        return cls(switchboard, build_app(switchboard, static_dir), measured, model.device.type)

    def run(self, sock, *, ssl_cert: str | None = None, ssl_key: str | None = None,
            on_ready: Callable[[Callable[[], None]], None], handle_signals: bool = True
            ) -> int | None:
        """Serves on `sock` until a signal (-> its number), an engine failure (-> None) or
        the `stop` that on_ready(stop) gets is called."""
        from .runner import serve

        return serve(self.switchboard, self.app, sock, ssl_cert=ssl_cert, ssl_key=ssl_key,
                     on_ready=on_ready, handle_signals=handle_signals)
