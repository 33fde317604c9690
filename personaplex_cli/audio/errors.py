"""Error type for everything that can go wrong while reading or writing audio.

The CLI turns an `AudioError` into a one-line message on stderr and a non-zero
exit status, so its message must be readable on its own (no traceback, no
libsndfile/cffi jargon) and name the input when that helps.
"""


from ..errors import InputError


class AudioError(InputError):
    """A user-facing audio input/output problem with a one-line human message."""
