"""The server's state, between the web app and the runtime: who is connected, the access
rules and limits, offline replies, figures and the shutdown. A caller's seat, its persona
and its row are the runtime's (Scheduler.admit, runtime.personas, Scheduler.add).

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

import numpy as np

from ..core.config import FRAME_SECONDS, SAMPLE_RATE
from ..errors import InputError, PersonaplexError
from ..runtime.rows import LiveRow, OfflineRow, RecordingRow
from ..runtime.scheduler import Callbacks
from ..transcript import SILENT, spoken
from . import protocol
from .access import Access
from .call import Call, Ending, Transport
from .metrics import Exposition
from .query import CallRequest, Defaults, QueryError, parse_call

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
# A streamed answer's frames waiting for its client (60 s of audio, about 5 MB): a client
# this far behind the engine is cut, its frames dropped. One that reads nothing at all is
# cut sooner, at --idle-timeout, by the connection layer (serve/connections.py).
STREAM_BUFFER_FRAMES = 750


TOKEN_NEEDED = "a valid token is needed: add ?token=TOKEN"
# The /v1 routes' word: the OpenAI SDK sends its api_key as this header.
BEARER_NEEDED = ("a valid token is needed: send it as the header Authorization: Bearer TOKEN "
                 "(the OpenAI SDK's api_key)")


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


# How a protocol holds an admitted caller (transport, request, "host:port"), and how it tells
# a refused one why before closing (transport, message, close code).
Serve = Callable[[Transport, CallRequest, str], Awaitable[None]]
Say = Callable[[Transport, str, int], Awaitable[None]]


class ServerClosing(PersonaplexError):
    """The server shuts down while an offline reply is in the engine."""


class RecordingTooLong(InputError):
    """An uploaded recording over MAX_REPLY_SECONDS (413)."""


class ClientGone(Exception):
    """Raised by a request body's chunks when the client has gone."""


@dataclass
class Answer:
    """An HTTP answer, for the app to send as it is: its body whole, or as it comes."""

    status: int
    body: bytes | AsyncIterator[bytes]
    content_type: str = "text/plain; charset=utf-8"
    error: PersonaplexError | None = None  # what refused the request, when something did
    done: Callable[[], None] = lambda: None  # for the app to call once the answer has gone

    @classmethod
    def text(cls, status: int, message: str) -> Answer:
        return cls(status, (message + "\n").encode())

    @classmethod
    def refusal(cls, error: PersonaplexError) -> Answer:
        """400, or the status the error carries (serve.chat.ChatError)."""
        answer = cls.text(getattr(error, "status", 400), error.message)
        answer.error = error
        return answer


class _StreamedRow(RecordingRow):
    """An offline row whose answer is handed to `listener(pcm, piece)` frame by frame, as
    the engine computes it (on the engine's thread), and not kept: the frames wait in the
    stream's own bounded buffer."""

    def __init__(self, *args, listener: Callable[[np.ndarray, str], None]):
        super().__init__(*args)
        self.listener = listener
        self.pieces: list[str] = []

    def collect(self, pcm, tokens, piece: str) -> None:
        self.pieces.append(piece)
        self.listener(pcm[:self.keep].copy(), piece)


class _Seat:
    """An offline request's seat (the scheduler's, admitted) and its client's count
    (--max-per-client), given back once."""

    def __init__(self, switchboard: Switchboard, address: str):
        self.switchboard, self.address = switchboard, address
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.switchboard.scheduler.release()
            self.switchboard.access.disconnect(self.address)


def _openai_error(answer: Answer) -> Answer:
    """A refusal as OpenAI's error JSON (serve/chat.py), with the field it is about."""
    from .chat import error_body

    error = answer.error
    message = error.message if error is not None else answer.body.decode().strip()
    return Answer(answer.status, error_body(answer.status, message,
                                            getattr(error, "param", None),
                                            getattr(error, "code", None)),
                  "application/json", error)


class Switchboard:
    """`scheduler` (a runtime Scheduler, TICK-paced, warmed up) runs the rows; `personas`
    (runtime.personas.Personas) prepares what callers ask for."""

    def __init__(self, model, scheduler, personas, defaults: Defaults, access: Access, *,
                 idle_timeout: float, log: Callable[[str], None],
                 debug: Callable[[str], None], voices_dir=None):
        self.model = model
        self.capacity = scheduler.capacity
        self.defaults = defaults
        self.access = access
        self.idle_timeout = idle_timeout
        self.log, self.debug = log, debug
        self.voices_dir = voices_dir
        self.personas = personas
        self.scheduler = scheduler
        scheduler.callbacks = Callbacks(
            frames=lambda batch: self._post(self._frames, batch),
            live=lambda row: self._post(self._went_live, row),
            done=lambda row: self._post(self._reply_done, row),
            refused=lambda row, error: self._post(self._refused, row, error),
            failed=lambda error: self._post(self._engine_failed, error))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sessions: set[Call] = set()
        self.started = time.monotonic()
        self.started_at = time.time()  # the models' `created`
        self.counts = collections.Counter()  # sessions, replies, refused:<why>, ...
        self.dropped_in = self.dropped_out = 0  # of the sessions that have ended
        self.dropped_pages = 0
        self.failure: BaseException | None = None
        self.on_fatal: Callable[[], None] = lambda: None
        self.closing = False
        self._replies: set[asyncio.Future] = set()  # offline replies in the engine
        self._closed = asyncio.Event()  # set at shutdown: replies in flight answer 503
        self.uploading = 0  # recordings being received or decoded
        self._numbers = 0

    @property
    def seats(self) -> int:
        """Live sessions and offline replies, joined or joining (the scheduler's count)."""
        return self.scheduler.seats

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.scheduler.start()

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
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop)

    def _engine_failed(self, error: BaseException) -> None:
        self.failure = error
        self.log(f"the engine failed: {type(error).__name__}: {error}")
        for session in list(self.sessions):
            session.end(Ending("engine failure", "internal error: the server's engine "
                               "stopped", protocol.CLOSE_INTERNAL))
        self.on_fatal()

    # -- a caller ------------------------------------------------------------------------------

    async def converse(self, transport: Transport, query: Mapping[str, str], query_bytes: int,
                       headers: Mapping[str, str], client: tuple[str, int], *,
                       serve: Serve | None = None, say: Say = refuse) -> None:
        """One WebSocket caller, from the accepted connection to its close: the access
        rules, the limits and a seat, then `serve` (NVIDIA's protocol unless another row
        source is given) holds the call; `say` tells a refused caller why, and closes."""
        address = client[0]
        who = f"{client[0]}:{client[1]}"
        serve = serve or self._call
        if not self.access.authorised(query, headers):
            return await self.refuse_caller(transport, "token", who, TOKEN_NEEDED,
                                      protocol.CLOSE_POLICY, say)
        if self.closing:
            return await self.refuse_caller(transport, "closing", who, SHUTTING_DOWN,
                                      protocol.CLOSE_TRY_AGAIN, say)
        if not self.access.connect(address):
            return await self.refuse_caller(
                transport, "per-client", who,
                too_many_from(address, self.access.max_per_client), protocol.CLOSE_TRY_AGAIN,
                say)
        try:
            try:
                request = parse_call(query, self.defaults, query_bytes)
            except QueryError as error:
                return await self.refuse_caller(transport, "query", who, error.message,
                                          protocol.CLOSE_POLICY, say)
            if not self.scheduler.admit():
                return await self.refuse_caller(transport, "full", who,
                                          slots_taken(self.capacity), protocol.CLOSE_TRY_AGAIN,
                                          say)
            try:
                await serve(transport, request, who)
            finally:
                self.scheduler.release()
        finally:
            self.access.disconnect(address)

    async def refuse_caller(self, transport: Transport, why: str, who: str, message: str,
                      code: int, say: Say = refuse) -> None:
        self.counts[f"refused:{why}"] += 1
        self.debug(f"refused {who}: {message}")
        await say(transport, message, code)

    async def _call(self, transport: Transport, request: CallRequest, who: str) -> None:
        number = self.next_number()
        if request.unknown:
            self.debug(f"session {number}: unknown query parameters ignored: "
                       f"{', '.join(ascii(name) for name in request.unknown)}")
        try:
            prompt, persona = await self.persona(request.voice, request.role)
            sampling = self.sampling(request)
        except PersonaplexError as error:
            return await self.refuse_caller(transport, "persona", who, error.message,
                                      protocol.CLOSE_POLICY)
        row = LiveRow(prompt, sampling, self.seed_for(request, number))
        session = Call(transport, row, number=number, client=who,
                          idle_timeout=self.idle_timeout, stats=request.stats,
                          engine_stats=self.scheduler.stats, add_row=self.scheduler.add,
                          remove_row=self.scheduler.remove)
        await self.hold(session, persona)

    async def hold(self, session: Call, persona: str) -> None:
        """A call, of any protocol, from its row's admission to its end: the figures, the
        metrics and the log lines."""
        number, who, row = session.number, session.client, session.row
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
            self.dropped_pages += session.dropped_messages
        seconds = time.monotonic() - (session.live_at or session.began)
        slot = "-" if not session.live else row.slot
        self.log(f"session {number} ended ({ending.reason}): slot {slot}, {persona}, "
                 f"{seconds:.1f} s, {row.frames} frames, dropped {row.dropped_in} in / "
                 f"{session.dropped_out} out, {session.dropped_messages} messages undecoded, "
                 f"{row.late} late, heard "
                 f"{session.level.call_dbfs:.0f} dBFS, client {who}")

    def next_number(self) -> int:
        self._numbers += 1
        return self._numbers

    def seed_for(self, request: CallRequest, number: int) -> int | None:
        if request.seed is not None:
            return request.seed
        if self.defaults.seed is not None:  # --seed N: session k draws from N + k - 1
            return self.defaults.seed + number - 1
        return None

    def sampling(self, request: CallRequest):
        from ..core.sampling import Sampling

        return Sampling(temp_text=request.temp_text, top_k_text=request.top_k_text,
                        temp_audio=request.temp_audio, top_k_audio=request.top_k_audio,
                        greedy=request.greedy)

    async def persona(self, voice_name: str | None, role: str):
        """(PersonaPrompt, its description for the log), prepared once per voice and role
        (runtime.personas.Personas) and held to --max-prime-s (the scheduler's limit)."""
        # An empty role prompt means none, as NVIDIA's server reads it.
        role = role if role.strip() else None
        try:
            prompt = self.personas.kept(voice_name, role)
            if prompt is None:  # reading a voice file is no work for the event loop
                prompt = await asyncio.get_running_loop().run_in_executor(
                    None, self._prepare, voice_name, role)
            self.scheduler.check_priming(prompt)
        except PersonaplexError as error:
            self.debug(f"persona refused: {error.message}")
            raise InputError(_for_caller(error, voice_name)) from None
        excerpt = (role or "").strip()[:40] + ("…" if len((role or "").strip()) > 40 else "")
        return prompt, (f"voice {prompt.voice_name or 'none'}, role {excerpt!r} "
                        f"({len(prompt.text_tokens)} tokens)")

    def _prepare(self, voice_name: str | None, role: str | None):
        prompt = self.personas.prompt(voice_name, role)
        if prompt.frames > self.model.lm.context:
            self.debug(f"voice {prompt.voice_name or 'none'}: its priming takes "
                       f"{prompt.frames} frames, more than the model's context of "
                       f"{self.model.lm.context}: its start is lost")
        return prompt

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
        query, then what `_offline` checks. `body` yields the body's chunks (raising
        ClientGone if the client leaves); `client_gone` returns when the client has gone,
        once the body is read."""
        if not self.access.authorised(query, headers):
            return Answer.text(401, TOKEN_NEEDED)
        if self.closing:
            return Answer.text(503, SHUTTING_DOWN)
        try:
            request = parse_call(query, self.defaults, query_bytes)
            tail = _tail_seconds(query)
        except QueryError as error:
            return Answer.text(400, error.message)

        def recording(file):  # the body is the recording
            return request, tail, file, None

        row = await self._offline(body, headers, address, client_gone, recording)
        return row if isinstance(row, Answer) else _reply_answer(row, json_wanted)

    async def chat(self, body: AsyncIterator[bytes], query: Mapping[str, str],
                   headers: Mapping[str, str], address: str,
                   client_gone: Callable[[], Awaitable[None]]) -> Answer:
        """POST /v1/chat/completions (serve/chat.py): a JSON body with the recording in
        it, answered as /api/reply answers, with its limits; errors in OpenAI's JSON. With
        `stream`, the Answer's body yields server-sent events, a frame each as the engine
        computes it, and the slot and the client's count are held until the stream has
        gone out (`Answer.done`), its client has gone, or it was cut: STREAM_BUFFER_FRAMES
        waiting for a client that reads too slowly."""
        import json

        from .chat import ChatRequest, Completion, is_json, parse_chat

        if not self.access.authorised(query, headers):
            return _openai_error(Answer.text(401, BEARER_NEEDED))
        if self.closing:
            return _openai_error(Answer.text(503, SHUTTING_DOWN))
        if not is_json(headers.get("content-type", "")):
            return _openai_error(Answer.text(415, "the body is JSON: send the header "
                                             "Content-Type: application/json"))
        asked: list[ChatRequest] = []
        frames: asyncio.Queue = asyncio.Queue()
        cut = []

        def stream(pcm: np.ndarray, piece: str) -> None:  # a frame, on the event loop
            if cut:
                return
            if frames.qsize() < STREAM_BUFFER_FRAMES:
                frames.put_nowait((pcm, piece))
                return
            cut.append(True)
            self.counts["refused:slow reader"] += 1
            self.log(f"a stream to {address} cut: its client read over "
                     f"{STREAM_BUFFER_FRAMES * FRAME_SECONDS:.0f} s of audio behind the engine")
            while not frames.empty():  # its memory goes at once
                frames.get_nowait()
            work.cancel()

        def recording(file):
            import tempfile

            file.seek(0)
            request = parse_chat(file.read(), self.defaults)
            asked.append(request)
            audio = tempfile.TemporaryFile(prefix="personaplex-upload-")
            audio.write(request.recording)
            audio.flush()
            return request.call, 0.0, audio, stream if request.stream else None

        seats: list[_Seat] = []
        work = asyncio.ensure_future(self._offline(body, headers, address, client_gone,
                                                   recording, keep=seats))
        work.add_done_callback(lambda _: frames.put_nowait(None))

        def give_back() -> None:
            for seat in seats:
                seat.give_back()

        first = await frames.get()
        if first is None:  # refused, or answered whole
            give_back()
            row = work.result()
            if isinstance(row, Answer):
                return _openai_error(row)
            completion = Completion(asked[0], int(time.time()))
            pcm = np.concatenate(row.pcm) if row.pcm else np.zeros(0, np.float32)
            return Answer(200, json.dumps(completion.whole(pcm, row.pieces)).encode(),
                          "application/json")
        return Answer(200, self._events(asked[0], first, frames, work), "text/event-stream",
                      done=give_back)

    async def _events(self, request, first, frames: asyncio.Queue,
                      work: asyncio.Future) -> AsyncIterator[bytes]:
        """A streamed answer's server-sent events, while `work` computes it."""
        from .chat import Completion

        completion = Completion(request, int(time.time()))
        try:
            yield completion.opening()
            item, count = first, 0
            while item is not None:
                count += 1
                yield completion.frame(*item)
                item = await frames.get()
            if work.cancelled():
                yield completion.failure(408, "the client read the stream too slowly")
                return
            row = work.result()
            if isinstance(row, Answer):
                yield completion.failure(row.status, row.body.decode().strip())
            else:
                yield completion.closing(count)
        finally:
            if not work.done():  # the client went: the slot is freed
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)

    async def _offline(self, body: AsyncIterator[bytes], headers: Mapping[str, str],
                       address: str, client_gone: Callable[[], Awaitable[None]], recording,
                       keep: list | None = None):
        """An offline request through a slot -> its OfflineRow, or the Answer refusing it.

        Refused before a byte of the body is read: a declared length over the limit, no
        free slot, the uploads in flight, the client's quota (--max-per-client counts
        replies as connections). Once the body is in a file, `recording(file)` says what
        was asked: (CallRequest, tail seconds, the recording's file, `on_frame` or None).
        `on_frame(pcm, piece)` sees each frame of the answer, on the event loop, as the
        engine computes it, and the row keeps none. The work stops when the client goes or
        the server shuts down (503). The seat is given back at the end, or with `keep` put
        there for the caller to give back once its answer has gone out."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_REPLY_BYTES:
            return Answer.text(413, too_big(int(declared)))
        if not self.scheduler.admit():
            self.counts["refused:full"] += 1
            return Answer.text(503, slots_taken(self.capacity))
        if self.uploading >= MOST_UPLOADING:
            self.scheduler.release()
            self.counts["refused:uploads"] += 1
            return Answer.text(503, f"{MOST_UPLOADING} recordings are on their way in "
                               "already: try again later")
        if not self.access.connect(address):
            self.scheduler.release()
            self.counts["refused:per-client"] += 1
            return Answer.text(429, too_many_from(address, self.access.max_per_client))
        seat = _Seat(self, address)
        if keep is not None:
            keep.append(seat)
        cancelled = threading.Event()  # tells the decoding thread to stop
        work = asyncio.ensure_future(self._answer(body, recording, cancelled, client_gone))
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
            if keep is None:
                seat.give_back()

    async def _answer(self, body: AsyncIterator[bytes], recording,
                      cancelled: threading.Event,
                      client_gone: Callable[[], Awaitable[None]]):
        import contextlib
        import tempfile

        gone: asyncio.Future | None = None
        self.uploading += 1
        uploading = True
        try:
            # Files without a name: nothing of them is left in /tmp, whatever kills us.
            with contextlib.ExitStack() as files:
                file = files.enter_context(
                    tempfile.TemporaryFile(prefix="personaplex-upload-"))
                refused = await self._receive_body(body, file)
                if refused is not None:
                    return refused
                file.flush()
                gone = asyncio.ensure_future(client_gone())
                try:
                    # Reading a JSON body of megabytes would hold up the callers' I/O.
                    request, tail, audio, on_frame = await asyncio.get_running_loop(
                    ).run_in_executor(None, recording, file)
                    if audio is not file:
                        file.close()
                        files.enter_context(audio)
                    prompt, persona = await self.persona(request.voice, request.role)
                    decoding = asyncio.get_running_loop().run_in_executor(
                        None, _recording_frames, audio.fileno(), tail, cancelled)
                    await asyncio.wait([decoding, gone], return_when=asyncio.FIRST_COMPLETED)
                    if not decoding.done():
                        cancelled.set()
                        await asyncio.gather(decoding, return_exceptions=True)
                        return Answer.text(400, CLIENT_WENT)
                    frames = decoding.result()
                except RecordingTooLong as error:
                    return Answer.text(413, error.message)
                except PersonaplexError as error:
                    return Answer.refusal(error)
            self.uploading -= 1
            uploading = False
            return await self._through_engine(request, prompt, persona, frames, on_frame,
                                              gone)
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

    async def _through_engine(self, request: CallRequest, prompt, persona: str,
                              frames: list, on_frame, gone: asyncio.Future):
        """The decoded recording through a slot of the engine -> the OfflineRow with the
        whole answer, or the Answer saying why there is none."""
        done = asyncio.get_running_loop().create_future()
        row_args = (prompt, self.sampling(request), self.seed_for(request, self.next_number()),
                    iter(frames))
        row = OfflineRow(*row_args) if on_frame is None else _StreamedRow(
            *row_args, listener=lambda pcm, piece: self._post(on_frame, pcm, piece))
        row.owner = done
        began = time.monotonic()
        self._replies.add(done)
        self.scheduler.add(row)
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
            self.scheduler.remove(row)
        self.counts["replies"] += 1
        self.debug(f"reply: {persona}, {len(row.pieces)} frames in "
                   f"{time.monotonic() - began:.1f} s")
        return row

    # -- what the API tells ----------------------------------------------------------------------

    def voices(self) -> list[dict]:
        from ..prompts.voices import catalog

        return [{"name": name, "origin": voice.origin}
                for name, voice in sorted(catalog(self.voices_dir).items())]

    def summary(self) -> str:
        """What the server did, for its last line."""
        replies, stats = self.counts["replies"], self.scheduler.stats
        return (f"served {self.counts['sessions']} session(s) and {replies} offline "
                f"repl{'y' if replies == 1 else 'ies'}; {stats.steps} steps, "
                f"{stats.frames} frames")

    def metrics(self) -> str:
        stats = self.scheduler.stats
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
        x.add("replies_total", "counter", "Offline replies answered (POST /api/reply and "
              "/v1/chat/completions).",
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
              stats.real_time_factor())
        x.add("dropped_frames_total", "counter", "Frames dropped: caller audio beyond the "
              "input queue (in), assistant frames a client did not read (out).",
              [({"direction": "in"}, dropped_in), ({"direction": "out"}, dropped_out)])
        x.add("caller_pages_dropped_total", "counter", "Caller messages of audio (Ogg pages, "
              "Realtime appends) dropped undecoded: sent over a second ahead of real time.",
              self.dropped_pages + sum(s.dropped_messages for s in self.sessions))
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
            pairs = list(frames_with_tail(_Bounded(frames, cancelled),
                                          round(tail_seconds * SAMPLE_RATE)))
    except InputError as error:
        # The caller sent a body, not a file: the server's path means nothing to it.
        raise type(error)(error.message.replace(path, "the request's body")) from None
    if frames.samples == 0:
        raise InputError("the recording holds no audio samples")
    return pairs


class _Bounded:
    """An InputFrames stopped at MAX_REPLY_SECONDS or once `cancelled` is set; its
    `samples` are the input's, so that frames_with_tail trims the answer to the
    recording's own length (not to its whole frames)."""

    def __init__(self, frames, cancelled: threading.Event):
        self.frames, self.cancelled = frames, cancelled

    @property
    def samples(self) -> int:
        return self.frames.samples

    def __iter__(self):
        most = math.ceil(MAX_REPLY_SECONDS / FRAME_SECONDS)
        for count, frame in enumerate(self.frames, 1):
            if self.cancelled.is_set():
                raise InputError(CLIENT_WENT)
            if count > most:
                raise RecordingTooLong(f"the recording is longer than the limit of "
                                       f"{MAX_REPLY_SECONDS:.0f} s")
            yield frame


def _reply_answer(row, json_wanted: bool) -> Answer:
    import json

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
             "text": spoken(row.pieces),
             "pieces": pieces, "frame_pieces": row.pieces,
             "wav_base64": base64.b64encode(wav.getvalue()).decode("ascii")}
    return Answer(200, json.dumps(value).encode(), "application/json")
