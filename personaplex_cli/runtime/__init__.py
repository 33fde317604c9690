"""What runs conversations for every command: one scheduler and the decisions reply, talk
and serve share.

- `scheduler`: the one `Scheduler`: it owns the ConversationBatch and is the only code that
               steps or primes it. One `Row` record (persona, sampling, seed, slot,
               lifecycle, counters) with its sources (`LiveRow`: a network caller;
               `RecordingRow`/`OfflineRow`: a recording; talk's source in live/loop.py), and
               three pacings: TICK (serve, `start`/`add`/`remove`), SOURCE (talk, `follow`),
               FREE (reply and the Ray workers, `answer`). Also talk's lockstep
               `Conversation` and reply's `ReplyRequest`/`ReplyFrame`/`longest_first`.
- `stats`:     `StepStats`, the one statistics object every command reads (steps, frames,
               late, overruns, priming, step p50/p99), and `Histogram`.
- `limits`:    the bounds every live command shares (caller queue, speaker buffer).
- `warmup`:    the one warm-up: torch's thread count and how many rows keep real time, from
               step times measured as the session will run (`percentile_ms` is their measure).

What stays above: serve/ keeps the network (WebSocket calls, Opus) and the Switchboard's
admission and limits; live/ keeps the sound card, echo cancellation and the jitter buffer;
batch.py and cluster/ keep reading inputs and writing outputs.
"""
