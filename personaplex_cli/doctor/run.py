"""Every doctor check, in the order reported."""

from __future__ import annotations

from ..errors import EXIT_FAILURE
from .audio import check_audio, check_echo_canceller
from .check import FAIL, Check
from .hub import check_disk, check_token
from .model import ModelState, check_model
from .compute import check_python, check_torch_and_gpus, model_arch
from .serve import check_serve
from .threads import check_threads


def run_checks(model: str | None = None, dtype: str | None = None, timer=None,
               quantize: str = "none", verify: bool = False) -> list[Check]:
    """Every check, in the order reported. `timer(name, seconds)` hears how long each took.

    A check that raises (a bug, or a library failing in a way not foreseen) becomes a
    failed check of its own, so the others are still reported."""
    import time
    import traceback

    def timed(name, function, *args, fallback=None):
        start = time.perf_counter()
        try:
            value = function(*args)
        except Exception as error:  # noqa: BLE001 - reported as a check, never a traceback
            failed = Check(name, FAIL, f"the check itself failed: {type(error).__name__}: "
                           f"{error}", "please report it (-vv shows the traceback)",
                           EXIT_FAILURE)
            if timer is not None:
                timer(name, time.perf_counter() - start,
                      "".join(traceback.format_exception(error)))
            return fallback(failed) if fallback else failed
        if timer is not None:
            timer(name, time.perf_counter() - start, None)
        return value

    results: list[Check] = [timed("python", check_python)]
    results.extend(timed("torch", check_torch_and_gpus, dtype, quantize, model_arch(model),
                         fallback=lambda c: [c]))
    model_check, state = timed("model", check_model, model, verify,
                               fallback=lambda c: (c, ModelState("invalid", False)))
    results.append(model_check)
    results.append(timed("hf-token", check_token, state))
    results.append(timed("disk", check_disk, state))
    results.extend(timed("portaudio", check_audio, fallback=lambda c: [c]))
    results.append(timed("echo-cancel", check_echo_canceller))
    results.append(timed("serve", check_serve))
    results.append(timed("threads", check_threads))
    return results
