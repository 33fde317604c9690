"""User-facing errors and the exit status each one ends in.

Every error a user can cause derives from `PersonaplexError` and carries a one-line message;
the CLI prints it on stderr and exits with the class's code. The one home of the library's
error classes (cli/errors.py maps them to exit statuses); this module imports nothing heavy,
so the CLI can name these classes without loading torch or numpy.
"""

from __future__ import annotations

# Exit statuses (documented in the README and the man page).
EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected internal error
EXIT_USAGE = 2  # bad option or argument (Typer's own)
EXIT_MODEL_MISSING = 3  # the model or one of its files is not on this machine
EXIT_AUDIO_DEVICE = 4  # a live audio device could not be used
EXIT_DEVICE = 5  # the requested compute device (e.g. CUDA) is not available
EXIT_MODEL_INVALID = 6  # a model file is corrupt or does not match the architecture
EXIT_BAD_INPUT = 7  # the input is not valid audio / codes
EXIT_OUTPUT = 8  # the output cannot be written (exists, unwritable, a terminal)
EXIT_CLUSTER = 9  # --ray: Ray is not installed, or its cluster cannot be joined or used
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_BROKEN_PIPE = 141  # the reader of our stdout went away (128 + SIGPIPE)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15): unwound and cleaned up as after Ctrl-C


class PersonaplexError(Exception):
    exit_code = EXIT_FAILURE

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))

    @property
    def message(self) -> str:
        return self.args[0]


class ModelMissingError(PersonaplexError):
    exit_code = EXIT_MODEL_MISSING


class ModelInvalidError(PersonaplexError):
    exit_code = EXIT_MODEL_INVALID


class InputError(PersonaplexError):
    exit_code = EXIT_BAD_INPUT


class OutputError(PersonaplexError):
    exit_code = EXIT_OUTPUT


class DeviceError(PersonaplexError):
    exit_code = EXIT_DEVICE


class ClusterError(PersonaplexError):
    exit_code = EXIT_CLUSTER


class DownloadError(ModelMissingError):
    """The model could not be fetched from the Hugging Face hub (exit 3)."""


class HubAccessError(DownloadError):
    """A gated repo without access, or a token the hub rejects."""


class HubNotFoundError(DownloadError):
    """The repo, the revision or one of the files does not exist on the hub."""


class HubUnreachableError(DownloadError):
    """The hub could not be reached (connection refused, DNS, timeout, proxy)."""


class DiskFullError(OutputError):
    """No space left where the model is being written (exit 8)."""


class UnsafeArchiveError(ModelInvalidError):
    """An archive (voices.tgz) holds a member that would escape its folder or is not a plain file."""


class AudioError(InputError):
    """A user-facing audio input/output problem with a one-line human message (no
    traceback, no libsndfile/cffi jargon), naming the input when that helps."""


class AudioDeviceError(PersonaplexError):
    """Any live audio device failure: no PortAudio, no input/output device, unsupported
    rate, a device that disappeared or stopped calling back. The CLI exits with 4."""

    exit_code = EXIT_AUDIO_DEVICE


class EchoCancellerMissing(PersonaplexError):
    """The echo canceller's library is not installed; the message names `--no-echo-cancel`.
    Also exit 4: like a missing device, the live audio path cannot be set up as asked."""

    exit_code = EXIT_AUDIO_DEVICE


class EngineStalled(DeviceError):
    """A live session's engine thread did not come back from a model step (or from
    handing its answer on) in far longer than the warm-up measured: the compute device, or
    its driver, stopped answering. Exit 5, as for a compute device that cannot be used."""
