"""OpenAI's Realtime API on `GET /v1/realtime` (WebSocket, JSON events): one more row source
on the switchboard, beside NVIDIA's `/api/chat`, with its seats, limits, persona cache and
metrics (switchboard.converse admits the caller; `serve_realtime` holds the call).

A full-duplex model against a turn-based protocol:
- The caller's `input_audio_buffer.append` audio is the caller's stream: decoded from its
  wire format (audio/pcm 24 kHz, audio/pcmu or audio/pcma 8 kHz through soxr), cut into
  80 ms frames and put in the row's bounded input queue as it comes, as `/api/chat` does,
  with its allowance (serve/pace.py): an append beyond real time plus a second is dropped
  before it is decoded, counted.
  `commit` and `clear` are answered and change nothing: the model always listens.
- The persona is primed once the client has said what it wants: its first
  `session.update` that sets `instructions`, its first audio, or OPENING_S after
  `session.created` (all the updates before then apply). `session.updated`
  follows when the row is live. From then on the persona (instructions, voice, sampling,
  seed) is fixed: an update that would change it is refused whole with an `error` event
  (code `persona_fixed`); formats and turn detection may change at any time. Audio sent
  before the row is live is not stepped (the caller spoke before the assistant was there).
- The model's speech becomes responses (`Responses`): a response opens at the first frame
  with a text piece or audible audio and closes after END_QUIET_FRAMES frames with neither;
  every frame between is sent, one `response.output_audio.delta` each, with its text piece
  as `response.output_audio_transcript.delta`. Between responses nothing is sent.
  `response.cancel` closes the current response (`cancelled`) and keeps the rest of that
  stretch off the wire; the model runs on. A response the caller talked over (VAD's
  `speech_started` while it was open) ends `cancelled` with reason `turn_detected`.
- The caller's turns (`speech_started`/`speech_stopped`) come from a level measure on 20 ms
  windows of the caller's audio (`SpeechDetector`), times on the caller's timeline (audio
  appended since connect), while turn detection is on; `turn_detection: null` stops them.
- What a client sends costs the server no more than an `/api/chat` caller's: one message
  limit (protocol.MAX_MESSAGE_BYTES; over it, an `error` event and close 1009), no
  compression, the appends' allowance and the byte budget of serve/pace.py, a bounded
  echo of the client's own strings, and a turn for the other callers after each message
  in and each event out.
- Event names are the GA API's. A client that connects with the header
  `OpenAI-Beta: realtime=v1` (as beta clients do) gets the beta names of the events whose
  name changed (`response.audio.delta`, `response.audio_transcript.delta`, ...) and the
  beta shape of the session. Both shapes of `session.update` are read from every client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import itertools
import json
import secrets
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np

from ..audio.level import SPEAKING_DBFS, dbfs
from ..audio.resample import Reframer
from ..audio.telephony import WIRE_FORMATS, WireDecoder, WireEncoder
from ..core.config import FRAME_MS, FRAME_SIZE, SAMPLE_RATE
from ..errors import PersonaplexError
from ..transcript import SILENT
from . import protocol
from .call import SEND_TIMEOUT_S, Call, Cut, Ending, Transport
from .pace import Allowance
from .openai_models import MODEL_ID
from .query import CallRequest, Defaults, QueryError, parse_call

OPENING_S = 0.5  # without a word from the client, it is primed with the defaults after this
END_QUIET_FRAMES = 6  # 480 ms without a text piece or audible audio ends a response
SILENCE_MS = 500  # the caller's speech has stopped after this much quiet (silence_duration_ms)
VAD_WINDOW = FRAME_SIZE // 4  # 20 ms
VAD_WINDOW_MS = round(FRAME_MS) // 4
BETA_HEADER = "openai-beta"
# Events waiting for a client that sends and does not read (each bad event it sends adds an
# error event): past this, it is not reading, and the call ends.
MOST_WAITING_EVENTS = 512
# The longest of a client's own strings (its event_id, an item_id) that is echoed back;
# a longer one is not (null), so an event cannot make the server repeat a message's worth.
MOST_ECHOED_CHARS = 128

# GA name -> beta name, for the events whose name changed.
BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "conversation.item.added": "conversation.item.created",
}
GA_ONLY = ("conversation.item.done",)  # beta has no such event: not sent to beta clients
# Beta's format names.
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
# session.update's `personaplex` object: its fields are NVIDIA's query parameters (query.py).
PERSONAPLEX_FIELDS = ("text_topk", "audio_temperature", "audio_topk", "seed", "greedy")
# What makes the persona: an update that changes one of these once priming began is refused.
PERSONA_FIELDS = ("voice", "role", "temp_text", "top_k_text", "temp_audio", "top_k_audio",
                  "greedy", "seed")
# The error event's (code, type) for a call that ends, by the close code that follows it:
# the client's doing (a refusal, a message too big, nothing sent or read for
# --idle-timeout), or the server's (full, shutting down, failed).
CLOSING_ERRORS = {
    protocol.CLOSE_POLICY: ("policy_violation", "invalid_request_error"),
    protocol.CLOSE_TOO_BIG: ("message_too_large", "invalid_request_error"),
    protocol.CLOSE_NORMAL: ("idle_timeout", "invalid_request_error"),
    protocol.CLOSE_TRY_AGAIN: ("server_busy", "server_error"),
    protocol.CLOSE_GOING_AWAY: ("server_shutting_down", "server_error"),
    protocol.CLOSE_INTERNAL: ("internal_error", "server_error")}


def is_beta(headers: Mapping[str, str]) -> bool:
    return "realtime=v1" in headers.get(BETA_HEADER, "").replace(" ", "").lower()


def error_event(message: str, *, code: str, kind: str = "invalid_request_error",
                param: str | None = None, client_event: str | None = None,
                event_id: str | None = None) -> dict:
    return {"type": "error", "event_id": event_id or f"event_{secrets.token_hex(8)}",
            "error": {"type": kind, "code": code, "message": message, "param": param,
                      "event_id": client_event}}


async def refuse(transport: Transport, message: str, code: int) -> None:
    """A caller refused, or a call ended, on this route: an `error` event, then the close."""
    name, kind = CLOSING_ERRORS.get(code, ("closing", "server_error"))
    event = error_event(message, code=name, kind=kind)
    try:
        await asyncio.wait_for(transport.send(json.dumps(event)), SEND_TIMEOUT_S)
        await asyncio.wait_for(transport.close(code), SEND_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - it left already
        pass


class Refusal(Exception):
    """A client event the server answers with an `error` event (the call goes on)."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


class SpeechDetector:
    """The caller's turns, from the level of 20 ms windows: speech starts at the first
    window louder than SPEAKING_DBFS, and has stopped once `silence_ms` have passed
    without one (its end is the end of the last loud window)."""

    def __init__(self, silence_ms: int = SILENCE_MS):
        self.silence_ms = silence_ms
        self.windows = 0  # windows heard: the caller's timeline
        self.speaking = False
        self.loud_until_ms = 0

    def push(self, frame: np.ndarray) -> list[tuple[str, int]]:
        """One 80 ms frame -> [("started", audio_start_ms) | ("stopped", audio_end_ms)]."""
        turns = []
        for window in frame.reshape(-1, VAD_WINDOW):
            start_ms = self.windows * VAD_WINDOW_MS
            self.windows += 1
            if dbfs(float(np.dot(window, window)), len(window)) > SPEAKING_DBFS:
                if not self.speaking:
                    self.speaking = True
                    turns.append(("started", start_ms))
                self.loud_until_ms = start_ms + VAD_WINDOW_MS
            elif self.speaking and start_ms + VAD_WINDOW_MS - self.loud_until_ms \
                    >= self.silence_ms:
                self.speaking = False
                turns.append(("stopped", self.loud_until_ms))
        return turns


@dataclass
class Response:
    id: str
    item_id: str
    start_frame: int
    transcript: list
    talked_over: bool = False


class Responses:
    """The model's frames -> response events: each stretch of its speech is one response
    (see the module's docstring). `emit(type, **fields)` queues an event."""

    def __init__(self, emit: Callable[..., None], names: Callable[[str], str],
                 describe: Callable[[], dict], content_type: str):
        self.emit = emit
        self.content_type = content_type  # an item's audio content: beta's name differs
        self.new_id = names
        self.describe = describe  # the output audio's format and voice, for the response
        self.current: Response | None = None
        self.swallowing = False  # a cancelled stretch goes on, off the wire
        self.quiet = 0
        self.last_item: str | None = None  # the assistant's previous item

    def frame(self, index: int, pcm: np.ndarray, piece: str, encode) -> None:
        active = piece not in SILENT or dbfs(float(np.dot(pcm, pcm)), len(pcm)) > SPEAKING_DBFS
        if self.current is None and not self.swallowing:
            if not active:
                return
            self._begin(index)
        self.quiet = 0 if active else self.quiet + 1
        response = self.current
        if response is not None:
            where = dict(response_id=response.id, item_id=response.item_id, output_index=0,
                         content_index=0)
            self.emit("response.output_audio.delta", delta=encode(pcm), **where)
            if piece not in SILENT:  # the tokenizer's pieces carry their word mark as a space
                response.transcript.append(piece)
                self.emit("response.output_audio_transcript.delta", delta=piece, **where)
        if self.quiet >= END_QUIET_FRAMES:
            if response is not None:
                self._finish("cancelled" if response.talked_over else "completed",
                             "turn_detected" if response.talked_over else None)
            self.swallowing = False

    def cancel(self) -> bool:
        """response.cancel: False when no response is open."""
        if self.current is None:
            return False
        self._finish("cancelled", "client_cancelled")
        self.swallowing = True
        return True

    def talked_over(self) -> None:
        if self.current is not None:
            self.current.talked_over = True

    def _begin(self, index: int) -> None:
        self.current = response = Response(self.new_id("resp"), self.new_id("item"), index, [])
        self.emit("response.created", response=self._response(response, "in_progress"))
        self.emit("response.output_item.added", response_id=response.id, output_index=0,
                  item=self._item(response, "in_progress"))
        # The assistant's item joins the conversation (clients such as Pipecat open their
        # turn on it).
        self.emit("conversation.item.added", previous_item_id=self.last_item,
                  item=self._item(response, "in_progress"))
        self.last_item = response.item_id
        self.emit("response.content_part.added", response_id=response.id,
                  item_id=response.item_id, output_index=0, content_index=0,
                  part={"type": "audio", "transcript": ""})

    def _finish(self, status: str, reason: str | None) -> None:
        response, self.current = self.current, None
        transcript = "".join(response.transcript)
        where = dict(response_id=response.id, item_id=response.item_id, output_index=0,
                     content_index=0)
        item_status = "completed" if status == "completed" else "incomplete"
        self.emit("response.output_audio.done", **where)
        self.emit("response.output_audio_transcript.done", transcript=transcript, **where)
        self.emit("response.content_part.done", part={"type": "audio",
                                                       "transcript": transcript}, **where)
        self.emit("response.output_item.done", response_id=response.id, output_index=0,
                  item=self._item(response, item_status))
        self.emit("conversation.item.done", previous_item_id=None,
                  item=self._item(response, item_status))
        self.emit("response.done", response=self._response(
            response, status, reason, [self._item(response, item_status)]))

    def _item(self, response: Response, status: str) -> dict:
        return {"id": response.item_id, "object": "realtime.item", "type": "message",
                "role": "assistant", "status": status,
                "content": [{"type": self.content_type, "transcript":
                             "".join(response.transcript)}]}

    def _response(self, response: Response, status: str, reason: str | None = None,
                  output: list | None = None) -> dict:
        details = None if reason is None else {"type": status, "reason": reason}
        return {"id": response.id, "object": "realtime.response", "status": status,
                "status_details": details, "output": output or [],
                "output_modalities": ["audio"], "audio": {"output": self.describe()},
                # Where the response starts on the model's timeline (frames of 80 ms since
                # the row went live): how a client lines responses up with the model's audio.
                "metadata": {"start_frame": str(response.start_frame)}, "usage": None}


class RealtimeSession:
    """One caller's protocol state, without I/O: client events in (`handle`), the model's
    frames in (`model_frame`), server events out (`outbox`, JSON texts)."""

    def __init__(self, query: Mapping[str, str], request: CallRequest, defaults: Defaults, *,
                 beta: bool):
        self.query = dict(query)
        self.request = request  # the persona asked for (the query, then session.update)
        self.defaults = defaults
        self.beta = beta
        self.live = False
        self.fixed = False  # once priming begins, the persona cannot change
        self.wished = False  # the client has said what it wants (instructions, or audio)
        self.voice_used: str | None = None  # the voice primed, once known
        self.outbox: collections.deque[str] = collections.deque()
        self._tag = secrets.token_hex(4)
        self._numbers = itertools.count(1)
        self.in_format = self.out_format = "audio/pcm"
        self.decoder = WireDecoder(self.in_format)
        self.encoder = WireEncoder(self.out_format)
        self.allowance = Allowance()  # appends beyond real time are dropped undecoded
        self.turn_detection: dict | None = {"type": "server_vad",
                                            "silence_duration_ms": SILENCE_MS}
        self.detector = SpeechDetector()
        self.framer = Reframer(FRAME_SIZE)
        self.heard_item: str | None = None  # the caller's item of the speech going on
        self.previous_item: str | None = None
        self.responses = Responses(self.emit, self.new_id, self._output_audio,
                                   "audio" if beta else "output_audio")

    # -- events out ------------------------------------------------------------------------

    def new_id(self, kind: str) -> str:
        return f"{kind}_{self._tag}{next(self._numbers):06d}"

    def emit(self, kind: str, **fields) -> None:
        if self.beta:
            if kind in GA_ONLY:
                return
            kind = BETA_NAMES.get(kind, kind)
        self.outbox.append(json.dumps({"type": kind, "event_id": self.new_id("event"),
                                       **fields}))

    def refuse(self, refusal: Refusal, client_event: str | None) -> None:
        self.outbox.append(json.dumps(error_event(
            refusal.message, code=refusal.code, param=refusal.param,
            client_event=client_event, event_id=self.new_id("event"))))

    def created(self) -> None:
        self.emit("session.created", session=self.describe())

    def primed(self, voice: str | None) -> None:
        """The row is live, with `voice` (None: the server's default)."""
        self.live = True
        self.voice_used = voice if voice is not None else (self.defaults.voice or "none")
        self.emit("session.updated", session=self.describe())

    def describe(self) -> dict:
        """The session as the client's typed models read it (GA, or beta's flat shape)."""
        request = self.request
        sampling = {"temperature": request.temp_text, "personaplex": {
            "text_topk": request.top_k_text, "audio_temperature": request.temp_audio,
            "audio_topk": request.top_k_audio, "seed": request.seed,
            "greedy": request.greedy}}
        if self.beta:
            return {"object": "realtime.session", "id": f"sess_{self._tag}", "model": MODEL_ID,
                    "modalities": ["audio", "text"], "instructions": request.role,
                    "voice": self._voice(), "input_audio_format": _beta(self.in_format),
                    "output_audio_format": _beta(self.out_format),
                    "turn_detection": self.turn_detection,
                    "input_audio_transcription": None, "tools": [], "tool_choice": "none",
                    **sampling}
        return {"type": "realtime", "object": "realtime.session", "id": f"sess_{self._tag}",
                "model": MODEL_ID, "output_modalities": ["audio"],
                "instructions": request.role,
                "audio": {"input": {"format": _format(self.in_format),
                                    "turn_detection": self.turn_detection,
                                    "transcription": None, "noise_reduction": None},
                          "output": self._output_audio()},
                "tools": [], "tool_choice": "none", **sampling}

    def _voice(self) -> str:
        return self.voice_used or self.request.voice or self.defaults.voice or "none"

    def _output_audio(self) -> dict:
        return {"format": _format(self.out_format), "voice": self._voice()}

    # -- events in -------------------------------------------------------------------------

    def handle(self, message: bytes | str) -> list[np.ndarray]:
        """One client message -> the caller's frames it completes (refusals are queued as
        `error` events; the call goes on). A message over the limit raises
        protocol.BadMessage: the call ends."""
        protocol.check_size(message)
        event_id = None
        try:
            if not isinstance(message, str):
                raise Refusal("binary messages are not part of this protocol: send JSON "
                              "events as text", "invalid_event")
            try:
                event = json.loads(message)
            except ValueError:
                raise Refusal("the message is not JSON", "invalid_json") from None
            except RecursionError:
                raise Refusal("the message is JSON nested too deeply", "invalid_json") \
                    from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise Refusal("an event is a JSON object with a \"type\"", "invalid_event")
            event_id = _echoed(event.get("event_id"))
            return self._dispatch(event["type"], event, event_id)
        except Refusal as refusal:
            self.refuse(refusal, event_id)
        except Exception as error:  # noqa: BLE001 - a value of a shape no check foresaw
            # The promise is an error event and the call going on, whatever a client sends.
            self.refuse(Refusal(f"the event could not be read ({type(error).__name__})",
                                "invalid_event"), event_id)
        return []

    def _dispatch(self, kind: str, event: dict, event_id: str | None) -> list[np.ndarray]:
        if kind == "input_audio_buffer.append":
            return self._append(event.get("audio"))
        if kind == "session.update":
            self._update(event.get("session"), event_id)
        elif kind == "input_audio_buffer.commit":
            item, self.previous_item = self.new_id("item"), self.heard_item
            self.emit("input_audio_buffer.committed", item_id=item,
                      previous_item_id=self.previous_item)
        elif kind == "input_audio_buffer.clear":
            self.emit("input_audio_buffer.cleared")
        elif kind == "response.create":
            _check_response_create(event.get("response"))
        elif kind == "response.cancel":
            if not self.responses.cancel():
                raise Refusal("there is no response to cancel: the model is not speaking",
                              "response_cancel_not_active")
        elif kind == "conversation.item.truncate":
            # The model's own context cannot be edited: the client's view of the item is
            # its own business, and the answer says so by changing nothing else.
            item, index, end_ms = (event.get("item_id"), event.get("content_index", 0),
                                   event.get("audio_end_ms", 0))
            if _echoed(item) is None or not _count(index) or not _count(end_ms):
                raise Refusal("conversation.item.truncate names an item_id (a string of at "
                              f"most {MOST_ECHOED_CHARS} characters), a content_index and "
                              "an audio_end_ms (whole numbers from 0)", "invalid_value")
            self.emit("conversation.item.truncated", item_id=item, content_index=index,
                      audio_end_ms=end_ms)
        elif kind in ("conversation.item.create", "conversation.item.delete",
                      "conversation.item.retrieve"):
            raise Refusal("conversation items cannot be added, removed or read here: the "
                          "model takes the caller's audio only (no text input, no function "
                          "results)", "unsupported")
        elif kind in ("output_audio_buffer.clear", "transcription_session.update"):
            raise Refusal(f"{kind} is not supported here", "unsupported")
        else:
            raise Refusal(f"unknown event type {kind[:60]!r}", "unknown_event", "type")
        return []

    def _append(self, audio) -> list[np.ndarray]:
        if not isinstance(audio, str):
            raise Refusal("input_audio_buffer.append carries base64 audio in \"audio\"",
                          "invalid_event", "audio")
        self.wished = True
        # Counted by its length before a byte is decoded (base64: 3 bytes per 4 characters).
        if not self.allowance.take(self.decoder.samples(len(audio) * 3 // 4)):
            return []
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise Refusal("the appended audio is not valid base64", "invalid_audio",
                          "audio") from None
        self.framer.push(self.decoder.decode(data))
        frames = self.framer.pop_frames()
        for frame in frames:
            for turn, ms in self.detector.push(frame):
                if self.turn_detection is None:
                    continue
                if turn == "started":
                    self.heard_item = self.new_id("item")
                    self.responses.talked_over()
                    self.emit("input_audio_buffer.speech_started", audio_start_ms=ms,
                              item_id=self.heard_item)
                elif self.heard_item is not None:
                    self.emit("input_audio_buffer.speech_stopped", audio_end_ms=ms,
                              item_id=self.heard_item)
                    self.emit("input_audio_buffer.committed", item_id=self.heard_item,
                              previous_item_id=self.previous_item)
                    self.previous_item, self.heard_item = self.heard_item, None
        return frames

    def _update(self, session, event_id: str | None) -> None:
        """session.update: applied, but for what it asks that cannot be done (an error
        event each), or refused whole (a bad value, a persona change once primed)."""
        if not isinstance(session, dict):
            raise Refusal("session.update carries a \"session\" object", "invalid_event",
                          "session")
        audio = session.get("audio") if isinstance(session.get("audio"), dict) else {}
        audio_in = audio.get("input") if isinstance(audio.get("input"), dict) else {}
        audio_out = audio.get("output") if isinstance(audio.get("output"), dict) else {}
        # What it cannot do is named, and the rest applies: frameworks ask for tools and
        # transcription by default, and should still get the persona they asked for.
        unsupported = []
        if session.get("tools"):
            unsupported.append(Refusal("tools and function calls are not supported: the "
                                       "model speaks only", "unsupported", "session.tools"))
        if audio_in.get("transcription") or session.get("input_audio_transcription"):
            unsupported.append(Refusal("input transcription is not supported here (no speech "
                                       "recognition)", "unsupported",
                                       "session.audio.input.transcription"))
        modalities = session.get("output_modalities", session.get("modalities"))
        if modalities is not None and (not isinstance(modalities, list) or
                                       "audio" not in modalities):
            raise Refusal("the model answers in audio: output_modalities must hold "
                          "\"audio\"", "unsupported", "session.output_modalities")
        in_format = _read_format(audio_in.get("format", session.get("input_audio_format")),
                                 "session.audio.input.format", self.in_format)
        out_format = _read_format(audio_out.get("format",
                                                session.get("output_audio_format")),
                                  "session.audio.output.format", self.out_format)
        turns = self.turn_detection
        turns_given = "turn_detection" in audio_in or "turn_detection" in session
        if turns_given:
            turns = _read_turns(audio_in.get("turn_detection", session.get("turn_detection")))
        request, query = self._persona_asked(session, audio_out)
        if self.fixed and _persona(request) != _persona(self.request):
            raise Refusal("the persona (instructions, voice, sampling, seed) is fixed once "
                          "the call is primed: open a new connection for another one",
                          "persona_fixed", "session")
        self.request, self.query = request, query
        if in_format != self.in_format:
            self.in_format, self.decoder = in_format, WireDecoder(in_format)
            self.framer = Reframer(FRAME_SIZE)
        if out_format != self.out_format:
            self.out_format, self.encoder = out_format, WireEncoder(out_format)
        if turns_given:
            self.turn_detection = turns
            self.detector.silence_ms = (turns or {}).get("silence_duration_ms", SILENCE_MS)
        # A framework may open with its settings and send the instructions a moment later
        # (LiveKit Agents does): only an update that names them, or audio, ends the opening.
        self.wished = self.wished or "instructions" in session
        for refusal in unsupported:
            self.refuse(refusal, event_id)
        if self.live:
            self.emit("session.updated", session=self.describe())

    def _persona_asked(self, session: dict, audio_out: dict) -> tuple[CallRequest, dict]:
        """The update's persona, read through the query's own checks (query.parse_call),
        and the query it makes."""
        asked = {}
        if isinstance(session.get("instructions"), str):
            asked["text_prompt"] = session["instructions"]
        voice = audio_out.get("voice", session.get("voice"))
        if isinstance(voice, dict):
            voice = voice.get("id")
        if voice is not None:
            if not isinstance(voice, str):
                raise Refusal("the voice is named by a string", "invalid_value",
                              "session.audio.output.voice")
            asked["voice_prompt"] = voice
        if session.get("temperature") is not None:
            asked["text_temperature"] = _query_value(session["temperature"])
        extra = session.get("personaplex") or {}
        if not isinstance(extra, dict) or set(extra) - set(PERSONAPLEX_FIELDS):
            raise Refusal(f"personaplex holds only {', '.join(PERSONAPLEX_FIELDS)}",
                          "invalid_value", "session.personaplex")
        asked.update({name: _query_value(value) for name, value in extra.items()
                      if value is not None})
        query = {**self.query, **asked}
        try:
            return parse_call(query, self.defaults, 0), query
        except QueryError as error:
            raise Refusal(error.message, "invalid_value", "session") from None

    # -- the model's frames ------------------------------------------------------------------

    def model_frame(self, index: int, pcm: np.ndarray, piece: str) -> None:
        self.responses.frame(index, pcm, piece, self._encode)

    def _encode(self, pcm: np.ndarray) -> str:
        return base64.b64encode(self.encoder.encode(pcm)).decode("ascii")


def _echoed(value) -> str | None:
    """A client's string as it may be echoed back (None: not a string, or too long)."""
    return value if isinstance(value, str) and len(value) <= MOST_ECHOED_CHARS else None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _persona(request: CallRequest) -> tuple:
    return tuple(getattr(request, name) for name in PERSONA_FIELDS)


def _query_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _format(wire_format: str) -> dict:
    return {"type": wire_format, "rate": SAMPLE_RATE} if wire_format == "audio/pcm" \
        else {"type": wire_format}


def _beta(wire_format: str) -> str:
    return next(name for name, value in BETA_FORMATS.items() if value == wire_format)


def _read_format(value, param: str, current: str) -> str:
    if value is None:
        return current
    if isinstance(value, str):
        kind, rate = BETA_FORMATS.get(value, value), None
    elif isinstance(value, dict):
        kind, rate = value.get("type"), value.get("rate")
    else:
        kind, rate = None, None
    if kind not in WIRE_FORMATS or (kind == "audio/pcm" and rate not in (None, SAMPLE_RATE)):
        raise Refusal(f"audio formats here: audio/pcm at {SAMPLE_RATE} Hz, audio/pcmu and "
                      "audio/pcma at 8000 Hz (beta: pcm16, g711_ulaw, g711_alaw)",
                      "invalid_value", param)
    return kind


def _read_turns(value) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type", "server_vad") not in (
            "server_vad", "semantic_vad"):
        raise Refusal("turn_detection is null, or {\"type\": \"server_vad\"}",
                      "invalid_value", "session.audio.input.turn_detection")
    silence = value.get("silence_duration_ms", SILENCE_MS)
    if isinstance(silence, bool) or not isinstance(silence, int) or not 0 < silence <= 10_000:
        raise Refusal("silence_duration_ms is a whole number of ms from 1 to 10000",
                      "invalid_value", "session.audio.input.turn_detection")
    return {"type": "server_vad", "silence_duration_ms": silence}


def _check_response_create(response) -> None:
    """response.create: the model speaks when it decides, so a plain one changes nothing;
    one that asks for what the model cannot do is refused."""
    if response is None:
        return
    if not isinstance(response, dict):
        raise Refusal("response.create's \"response\" is an object", "invalid_event",
                      "response")
    if response.get("instructions"):
        raise Refusal("a response cannot take new instructions: the persona is primed once "
                      "per call", "unsupported", "response.instructions")
    if response.get("tools"):
        raise Refusal("tools and function calls are not supported", "unsupported",
                      "response.tools")
    if response.get("input"):
        raise Refusal("a response cannot take input items: the model hears the caller's "
                      "audio only", "unsupported", "response.input")


class RealtimeCall(Call):
    """A Call whose messages are the Realtime API's JSON events (the row, the queues, the
    idle watch and the figures are Call's)."""

    def __init__(self, transport: Transport, row, session: RealtimeSession, *,
                 pending: asyncio.Future | None, voice: str | None, **kwargs):
        super().__init__(transport, row, stats=False, **kwargs)
        self.session = session
        self.voice = voice  # the voice primed (None: the server's default)
        self._pending = pending  # a receive the opening began and did not finish
        self.produced = 0  # the model's frames for this row: the response timeline

    @property
    def dropped_messages(self) -> int:
        return self.session.allowance.dropped

    def deliver(self, pcm: np.ndarray, piece: str) -> None:
        super().deliver((self.produced, pcm), piece)
        self.produced += 1

    async def run(self) -> Ending:
        try:
            return await super().run()
        finally:
            if self._pending is not None:
                self._pending.cancel()

    async def _receive(self) -> None:
        try:
            while True:
                pending, self._pending = self._pending, None
                message = await (pending if pending is not None else self.transport.receive())
                if message is None:
                    self.end(Ending("client closed"))
                    return
                await self.budget.spend(len(message))
                frames = self.session.handle(message)
                if len(self.session.outbox) > MOST_WAITING_EVENTS:
                    self.end(Ending("not reading", f"over {MOST_WAITING_EVENTS} events wait "
                                    "for this client: closing", protocol.CLOSE_POLICY))
                    return
                if self.session.outbox:
                    self._ready.set()
                if not frames:
                    continue
                self.last_audio = time.monotonic()
                if not self.live:
                    self.early_frames += len(frames)
                    continue
                for frame in frames:
                    self.level.add(frame)
                    self.row.put(frame)
        except protocol.BadMessage as bad:
            self.end(Ending("bad message", str(bad), bad.close_code))
        except asyncio.CancelledError:
            raise
        except Cut as cut:
            self.end(Ending(str(cut)))
        except Exception as error:  # noqa: BLE001 - the transport failed: the client is gone
            self.end(Ending(f"connection lost ({type(error).__name__})"))

    async def _greet(self) -> None:
        self.session.primed(self.voice)  # session.updated: sent by the flush that follows

    async def _flush(self) -> None:
        """The events waiting, then each model frame's events, in order."""
        session, outbox = self.session, self.session.outbox
        while outbox or self._out:
            while outbox:
                await self.transport.send(outbox.popleft())
                await asyncio.sleep(0)  # a send that does not wait is no turn for the others
            if self._out:
                (index, pcm), piece = self._out.popleft()
                session.model_frame(index, pcm, piece)
                if piece not in SILENT:
                    self.pieces += 1
                self.sent_frames += 1
                self.last_read = time.monotonic()

    async def _say_and_close(self, message: str, code: int) -> None:
        await refuse(self.transport, message, code)


async def serve_realtime(switchboard, transport: Transport, request: CallRequest, who: str,
                         *, query: Mapping[str, str], beta: bool) -> None:
    """A caller admitted on `/v1/realtime` (a seat is held): `session.created`, the opening
    (until the client says what it wants, or OPENING_S), the persona, then the call."""
    number = switchboard.next_number()
    session = RealtimeSession(query, request, switchboard.defaults, beta=beta)
    session.created()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + OPENING_S
    pending: asyncio.Future | None = None
    try:
        while True:
            while session.outbox:
                await transport.send(session.outbox.popleft())
            if session.wished or loop.time() >= deadline:
                break
            pending = pending or asyncio.ensure_future(transport.receive())
            done, _ = await asyncio.wait({pending}, timeout=deadline - loop.time())
            if not done:
                break
            message, pending = pending.result(), None
            if message is None:
                return
            session.handle(message)  # audio before the row is live is not stepped
        session.fixed = True
        prepared = await _prime(switchboard, session, transport, who)
    except protocol.BadMessage as bad:
        switchboard.debug(f"realtime caller {who}: {bad}")
        return await refuse(transport, str(bad), bad.close_code)
    except Exception as error:  # noqa: BLE001 - the transport failed: the client is gone
        if pending is not None:
            pending.cancel()
        switchboard.debug(f"realtime caller {who} gone before priming "
                          f"({type(error).__name__})")
        return
    if prepared is None:
        if pending is not None:
            pending.cancel()
        return
    (prompt, persona), voice = prepared
    request = session.request
    row_request = replace(request, voice=voice)
    from ..runtime.rows import LiveRow

    row = LiveRow(prompt, switchboard.sampling(row_request),
                  switchboard.seed_for(row_request, number))
    call = RealtimeCall(transport, row, session, pending=pending, number=number, client=who,
                        idle_timeout=switchboard.idle_timeout,
                        engine_stats=switchboard.scheduler.stats,
                        add_row=switchboard.scheduler.add,
                        remove_row=switchboard.scheduler.remove, voice=voice)
    await switchboard.hold(call, persona)


async def _prime(switchboard, session: RealtimeSession, transport: Transport, who: str):
    """The persona asked for, prepared; a voice not found here gets an `error` event and
    the server's default voice instead. None when the call cannot go on (refused)."""
    request = session.request
    try:
        return await switchboard.persona(request.voice, request.role), request.voice
    except PersonaplexError as error:
        if request.voice is None:
            await switchboard.refuse_caller(transport, "persona", who, error.message,
                                      protocol.CLOSE_POLICY, refuse)
            return None
        session.refuse(Refusal(f"{error.message}; the server's default voice speaks "
                               "instead", "voice_not_found", "session.audio.output.voice"),
                       None)
        while session.outbox:
            await transport.send(session.outbox.popleft())
    try:
        return await switchboard.persona(None, request.role), None
    except PersonaplexError as error:
        await switchboard.refuse_caller(transport, "persona", who, error.message,
                                  protocol.CLOSE_POLICY, refuse)
        return None
