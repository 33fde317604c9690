"""Errors of the live audio path, each with a one-line message the CLI prints as is."""

from __future__ import annotations

from ..errors import EXIT_AUDIO_DEVICE, DeviceError, PersonaplexError


class AudioDeviceError(PersonaplexError):
    """Any live audio device failure: no PortAudio, no input/output device, unsupported
    rate, a device that disappeared or stopped calling back. The CLI exits with 4."""

    exit_code = EXIT_AUDIO_DEVICE


class EchoCancellerMissing(PersonaplexError):
    """The echo canceller's library is not installed; the message names `--no-echo-cancel`.

    Also exit 4: like a missing device, the live audio path cannot be set up as asked.
    """

    exit_code = EXIT_AUDIO_DEVICE


class EngineStalled(DeviceError):
    """A live session's engine thread did not come back from a model step (or from
    handing its answer on) in far longer than the warm-up measured: the compute device, or
    its driver, stopped answering. Exit 5, as for a compute device that cannot be used."""
