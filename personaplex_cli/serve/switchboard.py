"""The server's state, between the web app and the engine thread: who is connected, the
seats (one per slot), personas, offline replies, figures and the shutdown.

Everything here runs on the event loop, except the engine's callbacks, which only post to
it. Nothing here knows the web framework: `converse` takes a call.Transport and the
request's query, headers and client address; `reply` returns an `Answer`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Mapping

from ..core.config import FRAME_SECONDS, PERSONAS_CACHED, SAMPLE_RATE
from ..errors import InputError, PersonaplexError
from ..runtime.limits import role_prompt_refusal
from ..transcript import SILENT
from . import protocol
from .access import Access
from .call import Call, Ending, Transport
from .metrics import Exposition
from .query import CallRequest, Defaults, QueryError, parse_call
from .scheduler import Callbacks, LiveRow, OfflineRow, Scheduler

MAX_REPLY_BYTES = 64 * 1024 * 1024  # an uploaded recording (POST /api/reply)
MAX_REPLY_SECONDS = 600.0
MAX_TAIL_SECONDS = 60.0
SHUTDOWN_WAIT_S = 3.0
# Recordings being received or decoded at once (each decodes up to MAX_REPLY_SECONDS into
# memory); once decoded, a reply holds a slot like any caller.
MOST_UPLOADING = 2
# A body trickled in to hold a slot (slowloris on the body): it must keep coming.
BODY_PAUSE_S = 10.0
LEAST_BODY_RATE = 16 * 1024  # bytes a second, on average, once BODY_PAUSE_S has passed
SHUTTING_DOWN = "the server is shutting down"
CLIENT_WENT = "the client went before its answer was ready"


TOKEN_NEEDED = "a valid token is needed: add ?token=TOKEN"


def slots_taken(capacity: int) -> str:
    return f"all {capacity} conversation slots are taken: try again later"


def too_big(size: int) -> str:
    return f"the recording is {size} bytes, over the limit of {MAX_REPLY_BYTES} bytes"


def too_many_from(address: str, limit: int) -> str:
    return f"too many connections from {address} (at most {limit}): try again later"


async def refuse(transport: Transport, message: str, code: int) -> None:
    """A caller refused: `message` (0x05), then the close."""
    try:
        await asyncio.wait_for(transport.send(protocol.error(message)), 2.0)
        await asyncio.wait_for(transport.close(code), 2.0)
    except Exception:  # noqa: BLE001 - it left already
        pass


class ServerClosing(PersonaplexError):
    """The server shuts down while an offline reply is in the engine."""


class RecordingTooLong(InputError):
    """An uploaded recording over MAX_REPLY_SECONDS (413)."""


class ClientGone(Exception):
    """Raised by a request body's chunks when the client has gone."""


@dataclass
class Answer:
    """An HTTP answer, for the app to send as it is."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"

    @classmethod
    def text(cls, status: int, message: str) -> Answer:
        return cls(status, (message + "\n").encode())


class Switchboard:
    def __init__(self, model, slots, defaults: Defaults, access: Access, *,
                 idle_timeout: float, log: Callable[[str], None],
                 debug: Callable[[str], None], prime_cost_s: float = 0.01,
                 max_prime_s: float = 0.0, voices_dir=None):
        self.model = model
        self.capacity = slots.capacity
        self.defaults = defaults
        self.access = access
        self.idle_timeout = idle_timeout
        self.log, self.debug = log, debug
        self.voices_dir = voices_dir
        self.prime_cost_s, self.max_prime_s = prime_cost_s, max_prime_s
        self.engine = Scheduler(slots, Callbacks(
            frames=lambda batch: self._post(self._frames, batch),
            live=lambda row: self._post(self._went_live, row),
            done=lambda row: self._post(self._reply_done, row),
            refused=lambda row, error: self._post(self._refused, row, error),
            failed=lambda error: self._post(self._engine_failed, error)),
            prime_cost_s=prime_cost_s)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sessions: set[Call] = set()
        self.seats = 0  # live sessions and offline replies, joined or joining
        self.started = time.monotonic()
        self.counts = collections.Counter()  # sessions, replies, refused:<why>, ...
        self.dropped_in = self.dropped_out = 0  # of the sessions that have ended
        self.dropped_pages = 0
        self.failure: BaseException | None = None
        self.on_fatal: Callable[[], None] = lambda: None
        self.closing = False
        self._replies: set[asyncio.Future] = set()  # offline replies in the engine
        self._closed = asyncio.Event()  # set at shutdown: replies in flight answer 503
        self.uploading = 0  # recordings being received or decoded
        self._personas: collections.OrderedDict = collections.OrderedDict()
        self._numbers = 0

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.engine.start()

    def _post(self, callback, *args) -> None:
        """From the engine thread onto the event loop."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(callback, *args)

    async def shutdown(self, message: str = SHUTTING_DOWN) -> None:
        """Every session gets `message` and a close (1001), every reply in flight 503,
        then the engine stops."""
        self.closing = True
        self._closed.set()
        for session in list(self.sessions):
            session.end(Ending("server shutdown", message, protocol.CLOSE_GOING_AWAY))
        for reply in list(self._replies):
            if not reply.done():
                reply.set_exception(ServerClosing(message))
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    def _engine_failed(self, error: BaseException) -> None:
        self.failure = error
        self.log(f"the engine failed: {type(error).__name__}: {error}")
        for session in list(self.sessions):
            session.end(Ending("engine failure", "internal error: the server's engine "
                               "stopped", protocol.CLOSE_INTERNAL))
        self.on_fatal()

    # -- a caller ------------------------------------------------------------------------------

    async def converse(self, transport: Transport, query: Mapping[str, str], query_bytes: int,
                       headers: Mapping[str, str], client: tuple[str, int]) -> None:
        """One WebSocket caller, from the accepted connection to its close."""
        address = client[0]
        who = f"{client[0]}:{client[1]}"
        if not self.access.authorised(query, headers):
            return await self._refuse(transport, "token", who, TOKEN_NEEDED,
                                      protocol.CLOSE_POLICY)
        if self.closing:
            return await self._refuse(transport, "closing", who, SHUTTING_DOWN,
                                      protocol.CLOSE_TRY_AGAIN)
        if not self.access.connect(address):
            return await self._refuse(
                transport, "per-client", who,
                too_many_from(address, self.access.max_per_client), protocol.CLOSE_TRY_AGAIN)
        try:
            try:
                request = parse_call(query, self.defaults, query_bytes)
            except QueryError as error:
                return await self._refuse(transport, "query", who, error.message,
                                          protocol.CLOSE_POLICY)
            if self.seats >= self.capacity:
                return await self._refuse(transport, "full", who,
                                          slots_taken(self.capacity), protocol.CLOSE_TRY_AGAIN)
            self.seats += 1
            try:
                await self._call(transport, request, who)
            finally:
                self.seats -= 1
        finally:
            self.access.disconnect(address)

    async def _refuse(self, transport: Transport, why: str, who: str, message: str,
                      code: int) -> None:
        self.counts[f"refused:{why}"] += 1
        self.debug(f"refused {who}: {message}")
        await refuse(transport, message, code)

    async def _call(self, transport: Transport, request: CallRequest, who: str) -> None:
        number = self._next_number()
        if request.unknown:
            self.debug(f"session {number}: unknown query parameters ignored: "
                       f"{', '.join(ascii(name) for name in request.unknown)}")
        try:
            prompt, persona = await self._persona(request.voice, request.role)
            sampling = self._sampling(request)
        except PersonaplexError as error:
            return await self._refuse(transport, "persona", who, error.message,
                                      protocol.CLOSE_POLICY)
        row = LiveRow(prompt, sampling, self._seed(request, number))
        session = Call(transport, row, number=number, client=who,
                          idle_timeout=self.idle_timeout, stats=request.stats,
                          engine_stats=self.engine.stats, add_row=self.engine.add,
                          remove_row=self.engine.remove)
        session.on_live = lambda s: self.log(
            f"session {number} started: slot {s.row.slot}, {persona}, client {who}, primed "
            f"in {time.monotonic() - s.began:.1f} s")
        self.sessions.add(session)
        self.counts["sessions"] += 1
        try:
            ending = await session.run()
        finally:
            self.sessions.discard(session)
            self.dropped_in += row.dropped_in
            self.dropped_out += session.dropped_out
            self.dropped_pages += session.caller.dropped_pages
        seconds = time.monotonic() - (session.live_at or session.began)
        slot = "-" if not session.live else row.slot
        self.log(f"session {number} ended ({ending.reason}): slot {slot}, {persona}, "
                 f"{seconds:.1f} s, {row.frames} frames, dropped {row.dropped_in} in / "
                 f"{session.dropped_out} out, {session.caller.dropped_pages} pages undecoded, "
                 f"{row.late} late, heard "
                 f"{session.level.call_dbfs:.0f} dBFS, client {who}")

    def _next_number(self) -> int:
        self._numbers += 1
        return self._numbers

    def _seed(self, request: CallRequest, number: int) -> int | None:
        if request.seed is not None:
            return request.seed
        if self.defaults.seed is not None:  # --seed N: session k draws from N + k - 1
            return self.defaults.seed + number - 1
        return None

    def _sampling(self, request: CallRequest):
        from ..core.sampling import Sampling

        return Sampling(temp_text=request.temp_text, top_k_text=request.top_k_text,
                        temp_audio=request.temp_audio, top_k_audio=request.top_k_audio,
                        greedy=request.greedy)

    async def _persona(self, voice_name: str | None, role: str):
        """(PersonaPrompt, its description for the log), prepared once per voice and role."""
        key = (voice_name, role)
        if key in self._personas:
            self._personas.move_to_end(key)
            return self._personas[key]
        try:
            value = await asyncio.get_running_loop().run_in_executor(
                None, self._prepare, voice_name, role)
        except PersonaplexError as error:
            self.debug(f"persona refused: {error.message}")
            raise InputError(_for_caller(error, voice_name)) from None
        self._personas[key] = value
        while len(self._personas) > PERSONAS_CACHED:
            self._personas.popitem(last=False)
        return value

    def _prepare(self, voice_name: str | None, role: str):
        from ..conversation import Persona, prepare_persona
        from ..prompts.voices import find_named, find_voice

        if voice_name is None:
            voice = find_voice(self.defaults.voice, self.voices_dir,
                               self.model.files.voices_hint())
        else:
            voice = find_named(voice_name, self.voices_dir, self.model.files.voices_hint())
        # An empty role prompt means none, as NVIDIA's server reads it.
        prompt = prepare_persona(self.model, Persona(voice, role if role.strip() else None))
        excerpt = role.strip()[:40] + ("…" if len(role.strip()) > 40 else "")
        persona = (f"voice {voice.name if voice else 'none'}, role "
                   f"{excerpt!r} ({len(prompt.text_tokens)} tokens)")
        refusal = role_prompt_refusal(len(prompt.text_tokens), self.prime_cost_s,
                                      self.max_prime_s)
        if refusal is not None:
            raise InputError(refusal)
        if prompt.frames > self.model.lm.context:
            self.debug(f"{persona}: its priming takes {prompt.frames} frames, more than the "
                       f"model's context of {self.model.lm.context}: its start is lost")
        return prompt, persona

    # -- the engine's reports ------------------------------------------------------------------

    def _went_live(self, row) -> None:
        if isinstance(row.owner, Call):  # an offline reply needs no handshake
            row.owner.went_live()

    def _frames(self, batch: list) -> None:
        for row, pcm, piece in batch:
            if row.owner is not None:
                row.owner.deliver(pcm, piece)

    def _refused(self, row, error: Exception) -> None:
        owner = row.owner
        message = getattr(error, "message", str(error))
        if isinstance(owner, Call):
            owner.end(Ending("refused by the engine", message, protocol.CLOSE_POLICY))
        elif isinstance(owner, asyncio.Future) and not owner.done():
            owner.set_exception(InputError(message))

    def _reply_done(self, row) -> None:
        if isinstance(row.owner, asyncio.Future) and not row.owner.done():
            row.owner.set_result(row)

    # -- an offline request --------------------------------------------------------------------

    async def reply(self, body: AsyncIterator[bytes], query: Mapping[str, str],
                    query_bytes: int, headers: Mapping[str, str], address: str,
                    json_wanted: bool, client_gone: Callable[[], Awaitable[None]]) -> Answer:
        """POST /api/reply: a recording in, the reply as WAV (JSON with text and timings).

        Whatever can refuse it does so before a byte of the body is read: the token, the
        query, a declared length over the limit, a free slot, the uploads in flight, the
        client's quota (--max-per-client counts replies as connections). `body` yields the
        body's chunks (raising ClientGone if the client leaves); `client_gone` returns when
        the client has gone, once the body is read. The work stops when the client goes or
        the server shuts down (503)."""
        if not self.access.authorised(query, headers):
            return Answer.text(401, TOKEN_NEEDED)
        if self.closing:
            return Answer.text(503, SHUTTING_DOWN)
        try:
            request = parse_call(query, self.defaults, query_bytes)
            tail = _tail_seconds(query)
        except QueryError as error:
            return Answer.text(400, error.message)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_REPLY_BYTES:
            return Answer.text(413, too_big(int(declared)))
        if self.seats >= self.capacity:
            self.counts["refused:full"] += 1
            return Answer.text(503, slots_taken(self.capacity))
        if self.uploading >= MOST_UPLOADING:
            self.counts["refused:uploads"] += 1
            return Answer.text(503, f"{MOST_UPLOADING} recordings are on their way in "
                               "already: try again later")
        if not self.access.connect(address):
            self.counts["refused:per-client"] += 1
            return Answer.text(429, too_many_from(address, self.access.max_per_client))
        self.seats += 1
        cancelled = threading.Event()  # tells the decoding thread to stop
        work = asyncio.ensure_future(self._answer(body, request, tail, json_wanted,
                                                  cancelled, client_gone))
        closing = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait([work, closing], return_when=asyncio.FIRST_COMPLETED)
            return work.result() if work.done() else Answer.text(503, SHUTTING_DOWN)
        finally:
            cancelled.set()
            closing.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self.seats -= 1
            self.access.disconnect(address)

    async def _answer(self, body: AsyncIterator[bytes], request: CallRequest, tail: float,
                      json_wanted: bool, cancelled: threading.Event,
                      client_gone: Callable[[], Awaitable[None]]) -> Answer:
        import tempfile

        gone: asyncio.Future | None = None
        self.uploading += 1
        uploading = True
        try:
            # A file without a name: nothing of it is left in /tmp, whatever kills us.
            with tempfile.TemporaryFile(prefix="personaplex-upload-") as file:
                refused = await self._receive_body(body, file)
                if refused is not None:
                    return refused
                file.flush()
                gone = asyncio.ensure_future(client_gone())
                try:
                    prompt, persona = await self._persona(request.voice, request.role)
                    decoding = asyncio.get_running_loop().run_in_executor(
                        None, _recording_frames, file.fileno(), tail, cancelled)
                    await asyncio.wait([decoding, gone], return_when=asyncio.FIRST_COMPLETED)
                    if not decoding.done():
                        cancelled.set()
                        await asyncio.gather(decoding, return_exceptions=True)
                        return Answer.text(400, CLIENT_WENT)
                    frames = decoding.result()
                except RecordingTooLong as error:
                    return Answer.text(413, error.message)
                except PersonaplexError as error:
                    return Answer.text(400, error.message)
            self.uploading -= 1
            uploading = False
            return await self._offline(request, prompt, persona, frames, json_wanted, gone)
        finally:
            if uploading:
                self.uploading -= 1
            if gone is not None:
                gone.cancel()

    async def _receive_body(self, body: AsyncIterator[bytes], file) -> Answer | None:
        """The body into `file`; an Answer when it is refused (too big, too slow, gone)."""
        size = 0
        began = time.monotonic()
        chunks = aiter(body)
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(chunks), BODY_PAUSE_S)
                except StopAsyncIteration:
                    return None
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    return Answer.text(413, too_big(size))
                file.write(chunk)
                spent = time.monotonic() - began
                if spent > BODY_PAUSE_S and size < LEAST_BODY_RATE * spent:
                    raise asyncio.TimeoutError
        except ClientGone:
            return Answer.text(400, CLIENT_WENT)
        except asyncio.TimeoutError:
            self.counts["refused:slow upload"] += 1
            return Answer.text(408, f"the recording came too slowly (at least "
                               f"{LEAST_BODY_RATE // 1024} KiB/s, no pause over "
                               f"{BODY_PAUSE_S:g} s)")

    async def _offline(self, request: CallRequest, prompt, persona: str, frames: list,
                       json_wanted: bool, gone: asyncio.Future) -> Answer:
        """The decoded recording through a slot of the engine."""
        done = asyncio.get_running_loop().create_future()
        row = OfflineRow(prompt, self._sampling(request),
                         self._seed(request, self._next_number()), iter(frames))
        row.owner = done
        began = time.monotonic()
        self._replies.add(done)
        self.engine.add(row)
        try:
            await asyncio.wait([done, gone], return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                return Answer.text(400, CLIENT_WENT)  # nobody reads it; the slot is free
            done.result()
        except ServerClosing as closing:
            return Answer.text(503, closing.message)
        except PersonaplexError as error:
            return Answer.text(400, error.message)
        finally:
            self._replies.discard(done)
            self.engine.remove(row)
        self.counts["replies"] += 1
        self.debug(f"reply: {persona}, {len(row.pcm)} frames in "
                   f"{time.monotonic() - began:.1f} s")
        return _reply_answer(row, json_wanted)

    # -- what the API tells ----------------------------------------------------------------------

    def voices(self) -> list[dict]:
        from ..prompts.voices import catalog

        return [{"name": name, "origin": voice.origin}
                for name, voice in sorted(catalog(self.voices_dir).items())]

    def summary(self) -> str:
        """What the server did, for its last line."""
        replies, stats = self.counts["replies"], self.engine.stats
        return (f"served {self.counts['sessions']} session(s) and {replies} offline "
                f"repl{'y' if replies == 1 else 'ies'}; {stats.steps} steps, "
                f"{stats.frames} frames")

    def metrics(self) -> str:
        stats = self.engine.stats
        live = sum(session.live for session in self.sessions)
        dropped_in = self.dropped_in + sum(s.row.dropped_in for s in self.sessions)
        dropped_out = self.dropped_out + sum(s.dropped_out for s in self.sessions)
        refused = [({"reason": key.split(":", 1)[1]}, value)
                   for key, value in sorted(self.counts.items()) if key.startswith("refused:")]
        x = Exposition()
        x.add("sessions_live", "gauge", "Callers in a conversation now.", live)
        x.add("sessions_joining", "gauge", "Callers connected whose persona is being primed.",
              len(self.sessions) - live)
        x.add("slots", "gauge", "Conversation slots of the engine.",
              [({"state": "total"}, self.capacity), ({"state": "taken"}, self.seats)])
        x.add("sessions_total", "counter", "Sessions accepted since start.",
              self.counts["sessions"])
        x.add("replies_total", "counter", "Offline replies (POST /api/reply) answered.",
              self.counts["replies"])
        x.add("refused_total", "counter", "Connections refused, by reason.", refused or None)
        x.add("steps_total", "counter", "Engine steps (one for every live row).", stats.steps)
        x.add("frames_stepped_total", "counter", "80 ms frames stepped, summed over rows.",
              stats.frames)
        x.add("priming_frames_total", "counter", "Frames of persona priming run.",
              stats.primed_frames)
        x.add("step_seconds", "summary", "Time of one engine step, over the last "
              f"{stats.step_times.maxlen} steps.",
              [({"quantile": "0.5"}, _seconds(stats.step_ms(0.5))),
               ({"quantile": "0.99"}, _seconds(stats.step_ms(0.99)))])
        x.add("real_time_factor", "gauge", "Median step time over the 80 ms frame.",
              stats.real_time_factor)
        x.add("dropped_frames_total", "counter", "Frames dropped: caller audio beyond the "
              "input queue (in), assistant frames a client did not read (out).",
              [({"direction": "in"}, dropped_in), ({"direction": "out"}, dropped_out)])
        x.add("caller_pages_dropped_total", "counter", "Caller messages of Ogg pages dropped "
              "undecoded: audio sent over a second ahead of real time.",
              self.dropped_pages + sum(s.caller.dropped_pages for s in self.sessions))
        x.add("late_frames_total", "counter", "Caller frames that had not arrived at their "
              "step (silence was stepped).", stats.late)
        x.add("overrun_ticks_total", "counter", "Ticks that ran past the next one's time.",
              stats.overruns)
        x.add("uptime_seconds", "gauge", "Seconds since the server started.",
              round(time.monotonic() - self.started, 1))
        return x.text()


_PATH = re.compile(r"(?<![\w.])/[^\s'\",;:]+")


def _for_caller(error: PersonaplexError, voice_name: str | None) -> str:
    """A persona error as a caller may read it: no path of the server's, no list of its
    voices (GET /api/voices is there to ask)."""
    from ..prompts.voices import VoiceNotDownloadedError, VoiceNotFoundError

    if isinstance(error, VoiceNotFoundError):
        return f"unknown voice {voice_name!r}: GET /api/voices lists the voices here"
    if isinstance(error, VoiceNotDownloadedError):
        return (f"voice {voice_name!r} is not on this server: GET /api/voices lists the "
                "voices here")
    return _PATH.sub("(a file of the server)", error.message)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _tail_seconds(query: Mapping[str, str]) -> float:
    raw = query.get("tail_silence", "0")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= MAX_TAIL_SECONDS:
        raise QueryError(f"tail_silence must be a number of seconds from 0 to "
                         f"{MAX_TAIL_SECONDS:g}, not {raw[:40]!r}")
    return value


def _recording_frames(descriptor: int, tail_seconds: float,
                      cancelled: threading.Event) -> list:
    """The uploaded recording (an open file without a name) as (frame, samples to keep)
    pairs, as `reply` frames it; decoded as it goes, stopped at MAX_REPLY_SECONDS (a file
    that declares no length, or a false one, is not decoded whole to count it) or as soon
    as `cancelled` is set."""
    import os

    from ..audio.frames import InputFrames, frames_with_tail
    from ..audio.io import open_audio

    if os.fstat(descriptor).st_size == 0:
        raise InputError("the request has no recording in its body")
    path = f"/dev/fd/{descriptor}"
    os.lseek(descriptor, 0, os.SEEK_SET)
    try:
        with open_audio(path, count=False) as reader:
            if reader.duration is not None and reader.duration > MAX_REPLY_SECONDS:
                raise RecordingTooLong(f"the recording is {reader.duration:.0f} s long, "
                                       f"over the limit of {MAX_REPLY_SECONDS:.0f} s")
            frames = InputFrames(reader)
            pairs = list(frames_with_tail(_bounded(frames, cancelled),
                                          round(tail_seconds * SAMPLE_RATE)))
    except InputError as error:
        # The caller sent a body, not a file: the server's path means nothing to it.
        raise type(error)(error.message.replace(path, "the request's body")) from None
    if frames.samples == 0:
        raise InputError("the recording holds no audio samples")
    return pairs


def _bounded(frames, cancelled: threading.Event):
    most = math.ceil(MAX_REPLY_SECONDS / FRAME_SECONDS)
    for count, frame in enumerate(frames, 1):
        if cancelled.is_set():
            raise InputError(CLIENT_WENT)
        if count > most:
            raise RecordingTooLong(f"the recording is longer than the limit of "
                                   f"{MAX_REPLY_SECONDS:.0f} s")
        yield frame


def _reply_answer(row, json_wanted: bool) -> Answer:
    import json

    import numpy as np

    from ..audio.wav import WavWriter

    pcm = np.concatenate(row.pcm) if row.pcm else np.zeros(0, np.float32)
    wav = io.BytesIO()
    writer = WavWriter(wav, SAMPLE_RATE, 1, "s16", num_frames=len(pcm))
    writer.write(pcm)
    writer.close()
    if not json_wanted:
        return Answer(200, wav.getvalue(), "audio/wav")
    pieces = [{"frame": index, "start": round(index * FRAME_SECONDS, 3),
               "end": round((index + 1) * FRAME_SECONDS, 3), "piece": piece}
              for index, piece in enumerate(row.pieces) if piece not in SILENT]
    value = {"sample_rate": SAMPLE_RATE, "frames": len(row.pieces),
             "seconds": round(len(pcm) / SAMPLE_RATE, 3),
             "text": "".join(p["piece"] for p in pieces).strip(),
             "pieces": pieces, "frame_pieces": row.pieces,
             "wav_base64": base64.b64encode(wav.getvalue()).decode("ascii")}
    return Answer(200, json.dumps(value).encode(), "application/json")
