"""A server made ready: the model loaded, the default persona checked, the runtime opened
(its memory check and warm-up), the switchboard and the app built. `personaplex serve`
opens one and runs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.config import DEFAULT_COMPILE
from .access import Access
from .query import Defaults


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
             threads: int | None = None, max_prime_s: float = 0.0,
             graphs: bool | None = None,
             warn: Callable[[str], None] | None = None,
             compile_mode: str = DEFAULT_COMPILE) -> Server:
        """`threads`: torch's thread count as a deployment set it (else the warm-up's).
        `max_prime_s`: the most priming a caller's role prompt may take (0: no limit), at
        the warm-up's cost per frame; the server's own persona is held to it too.
        `graphs`: --graphs (None: auto); `warn` (else `log`) gets the line that says a
        capture failed on auto."""
        from ..errors import InputError
        from ..model.model import Model
        from ..prompts.voices import find_named, find_voice
        from ..runtime import open as open_runtime
        from ..runtime.personas import Personas
        from ..runtime.scheduler import Pacing
        from .app import build_app
        from .switchboard import Switchboard

        model = Model.open(model_spec, device, dtype, quantize, graphs=graphs,
                           compile_mode=compile_mode)
        debug(f"model: {model.path}; device: {model.device}, "
              f"{str(model.dtype).removeprefix('torch.')}, {quantize} quantization")
        voices_dir, hint = model.files.voices_dir(), model.files.voices_hint()

        def voice(name: str | None):  # a caller names a packaged voice, or gets the server's
            if name is None:
                return find_voice(defaults.voice, voices_dir, hint)
            return find_named(name, voices_dir, hint)

        personas = Personas(model, voice)
        # The server's own persona must work before any caller asks for it: as one who
        # names nothing asks for it, so that its primed state is theirs.
        prompt = personas.prompt(None, defaults.role)
        scheduler = open_runtime(model, prompt, max_sessions, Pacing.TICK,
                                 option="--max-sessions", threads=threads,
                                 max_prime_s=max_prime_s, say=debug, warn=warn or log,
                                 note=log)
        try:
            scheduler.check_priming(prompt)
        except InputError as error:
            raise InputError(f"--prompt: {error.message}") from None
        switchboard = Switchboard(model, scheduler, personas, defaults, access,
                                  idle_timeout=idle_timeout, log=log, debug=debug,
                                  voices_dir=voices_dir)
        return cls(switchboard, build_app(switchboard, static_dir), scheduler.warmup,
                   model.device.type)

    def run(self, sock, *, ssl_cert: str | None = None, ssl_key: str | None = None,
            on_ready: Callable[[Callable[[], None]], None], handle_signals: bool = True
            ) -> int | None:
        """Serves on `sock` until a signal (-> its number), an engine failure (-> None) or
        the `stop` that on_ready(stop) gets is called."""
        from .runner import serve

        return serve(self.switchboard, self.app, sock, ssl_cert=ssl_cert, ssl_key=ssl_key,
                     on_ready=on_ready, handle_signals=handle_signals)
