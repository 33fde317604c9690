"""Bounds the runtime holds every command to, each decided here once: the sessions a
server holds at most, and the priming a newcomer's role prompt may take. (The queues' bounds,
the caller's and the assistant's, are live/jitter.py's, beside the one queue of each.)

Only the standard library: the CLI reads these without loading torch.
"""

from __future__ import annotations

# Sessions a server holds by default: as many as the memory holds and keep real time (the
# warm-up's decision), never more than this.
MOST_SESSIONS = 64

# Device time a newcomer's role prompt may take to prime (--max-prime-s of serve and talk):
# a long prompt holds its own stream that long, and shares the primer meanwhile. 0 means no
# limit, reply's default: offline, nobody waits for the priming but the one who asked (on
# a CPU a 7B primes a token in seconds, and 10 s would refuse any role prompt there).
MAX_PRIME_S = 10.0
OFFLINE_MAX_PRIME_S = 0.0


def role_prompt_refusal(tokens: int, cost_s: float, max_prime_s: float) -> str | None:
    """Why a role prompt of `tokens` tokens (a priming frame each) is refused at `cost_s`
    seconds of device time per priming frame, or None if `max_prime_s` allows it."""
    need_s = tokens * cost_s
    if max_prime_s <= 0 or need_s <= max_prime_s:
        return None
    allowed = int(max_prime_s / cost_s) if cost_s > 0 else tokens
    return (f"the role prompt is {tokens} tokens, about {need_s:.1f} s of priming on this "
            f"device at {1000 * cost_s:.1f} ms a token; --max-prime-s {max_prime_s:g} allows "
            f"{allowed} tokens: shorten it")
