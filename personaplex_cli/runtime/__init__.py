"""What runs conversations for every command: the decisions reply, talk and serve share.

- `limits`: the bounds every live command shares (caller queue, speaker buffer).
- `warmup`: the one warm-up: torch's thread count and how many rows keep real time, from
            step times measured as the session will run (`percentile_ms` is their measure).
"""
