"""The runtime under reply, talk and serve.

- `warmup`: the one warm-up: torch's thread count and how many rows keep real time, from
            step times measured as the session will run (`percentile_ms` is their measure).
"""
