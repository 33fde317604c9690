"""Bounds every live command shares (talk and serve alike), each decided here once.

Only the standard library: live/ and the CLI read these without loading torch.
"""

from __future__ import annotations

# Caller frames that may wait for the engine before the oldest is dropped: 320 ms of the
# caller's voice at most reaches the model late, rather than later and later.
CALLER_QUEUE_FRAMES = 4

# Assistant audio the speaker's buffer holds beyond what it plays ahead (talk's --buffer):
# room for a burst of frames from an engine that caught up, without dropping any.
SPEAKER_BUFFER_MS = 480.0
