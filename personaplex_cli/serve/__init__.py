"""`personaplex serve`: NVIDIA's WebSocket protocol and OpenAI's Realtime API, many callers
batched on one device.

- `protocol`: the message kinds, their framing, the close codes; what a client may send.
- `opus`:     Ogg Opus in and out of a session (sphn), cut into the model's 80 ms frames.
- `query`:    what a caller asks for (persona, sampling, seed) from the query string.
- `access`:   the token, the origin check, the limits.
- `call`:     one caller's session, over async send/receive callables: no web framework in it.
- `realtime`: OpenAI's Realtime API (`/v1/realtime`): its events, a session's state, the
              model's speech as responses, the caller's turns; a Call of its own.
- `openai_models`: the model names OpenAI's routes answer to.
- `switchboard`: the server's state: sessions, offline replies, metrics, shutdown, access
              and limits. A caller's seat, persona and row are the runtime's: it asks the
              Scheduler (runtime/scheduler.py, TICK pacing) for a seat and submits the row,
              and the Scheduler owns it from there, stepping every live row every 80 ms on
              its own thread and priming newcomers in the time a tick leaves over.
- `app`:      the Starlette application (routes, static files) over the switchboard.
- `runner`:   uvicorn on a socket bound after warm-up, signals, the start-up line.
- `connections`: uvicorn's protocols with a head timeout, a cap on connections that
              evicts idle ones, and sockets cut when their client stops reading.
- `page/`:    the web page at `/` (static files; Opus through the vendored opus-recorder).

Threads: the engine thread (the runtime's scheduler) runs the model; the asyncio thread
does the WebSocket I/O and Opus. They meet only in bounded per-session queues and one batch callback per tick.
"""
