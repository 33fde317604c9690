"""`POST /v1/chat/completions` with audio: a recording in, the spoken answer out, in the
shape the request came in. No web framework here: bytes in, dicts and bytes out.

Two request shapes, told apart by `audios`:
- OpenAI's: a `user` message whose content holds one `input_audio` part
  (`{"data": base64, "format": "wav"|"mp3"|...}`); `system` messages are the role prompt;
  `audio: {"voice", "format"}`; `temperature`, `top_k`, `seed`.
- SGLang-Omni's: `audios: ["data:audio/wav;base64,..."]` (data URIs only: a path or a URL is
  refused, nothing is fetched); `stage_params.preprocessing.{voice, text_prompt}`;
  `stage_params.lm.{audio_temperature, audio_top_k, seed}` (read at the top level too).
Both shapes take every field above; only where the recording is and the answer's shape
differ. PersonaPlex hears audio only: a user message with text, an earlier turn, a tool, or
more than one recording is refused.

The answer is `reply`'s on the same recording, persona and seed: one frame out per 80 ms
frame in, trimmed to the recording's length. `usage` counts those frames. Nothing is kept
after the answer, so `expires_at` is the answer's own time.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import uuid
from dataclasses import dataclass

import numpy as np

from ..core.config import MAX_SEED, SAMPLE_RATE
from ..errors import InputError
from ..transcript import SILENT, spoken
from .openai_models import MODEL_ID, is_served, unknown_model
from .query import MAX_TEMPERATURE, CallRequest, Defaults, QueryError, voice_name

# input_audio.format: what the request says it sent. Everything but pcm16 is read by its
# content (as `reply` reads a file); pcm16 is headerless: 24 kHz mono 16-bit little-endian.
INPUT_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "pcm16")
# audio.format -> the writer's format (audio.writers). OpenAI's mp3 and aac are not written.
OUTPUT_FORMATS = {"wav": "wav", "pcm16": "raw", "flac": "flac", "opus": "opus"}
MEDIA_TYPES = {"wav": "audio/wav", "pcm16": "audio/pcm", "flac": "audio/flac",
               "opus": "audio/ogg"}
MODALITIES = ("text", "audio")
STREAM_FORMAT = "pcm16"  # a stream's pieces are raw frames, as OpenAI streams audio
MAX_TOP_K = 1_000_000
DONE = b"data: [DONE]\n\n"

# HTTP status -> OpenAI's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "invalid_request_error", 415: "invalid_request_error",
               421: "invalid_request_error",
               429: "rate_limit_error", 503: "server_error"}


class ChatError(InputError):
    """A request refused, with its HTTP status and the field it is about."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> bytes:
    """OpenAI's error JSON."""
    return json.dumps({"error": {"message": message,
                                 "type": ERROR_TYPES.get(status, "server_error"),
                                 "param": param, "code": code}}).encode()


@dataclass(frozen=True)
class ChatRequest:
    call: CallRequest  # persona, sampling and seed, as a query string gives them
    recording: bytes  # an audio file as `reply` reads one
    sglang: bool  # SGLang-Omni's shape: its answer too
    model: str  # the id the answer names
    modalities: tuple[str, ...]
    audio_format: str  # a key of OUTPUT_FORMATS
    stream: bool
    include_usage: bool


def is_json(content_type: str) -> bool:
    """Whether a Content-Type header says JSON (what the OpenAI SDK sends)."""
    return content_type.split(";")[0].strip().lower() == "application/json"


def parse_chat(body: bytes, defaults: Defaults) -> ChatRequest:
    """A request's JSON body -> ChatRequest; ChatError names what is wrong."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ChatError("the body is not JSON: a chat completion request is a JSON "
                        "object") from None
    except RecursionError:
        raise ChatError("the body is JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ChatError("the body must be a JSON object")
    model = value.get("model")
    if model is not None and not (isinstance(model, str) and is_served(model)):
        raise ChatError(unknown_model(str(model)), 404, "model", "model_not_found")
    if value.get("n", 1) != 1:
        raise ChatError("n must be 1: one recording has one answer", param="n")
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if value.get(name):
            raise ChatError(f"{name} are not supported: this model speaks, it calls no "
                            "tools", param=name)
    sglang = "audios" in value
    system, parts = _messages(value.get("messages"), sglang)
    recording = _sglang_audio(value["audios"], parts) if sglang else _openai_audio(parts)
    stage = _object(value, "stage_params") or {}
    preprocessing = _object(stage, "preprocessing", "stage_params.") or {}
    lm = _object(stage, "lm", "stage_params.") or {}
    audio = _object(value, "audio") or {}
    stream = _boolean(value, "stream")
    modalities = _modalities(value.get("modalities", list(MODALITIES)))
    audio_format = audio.get("format", STREAM_FORMAT if stream else "wav")
    if not isinstance(audio_format, str) or audio_format not in OUTPUT_FORMATS:
        raise ChatError(f"audio.format {str(audio_format)[:20]!r} is not written here: "
                        f"{', '.join(OUTPUT_FORMATS)}", param="audio.format")
    if stream and "audio" in modalities and audio_format != STREAM_FORMAT:
        raise ChatError(f"a stream's audio is {STREAM_FORMAT} (80 ms pieces): ask for "
                        f"audio.format {STREAM_FORMAT!r}", param="audio.format")
    role = preprocessing.get("text_prompt", system)
    if role is not None and not isinstance(role, str):
        raise ChatError("stage_params.preprocessing.text_prompt must be a string",
                        param="stage_params.preprocessing.text_prompt")
    if role is not None:
        from ..model.tokenizer import not_utf8

        problem = not_utf8(role)
        if problem is not None:
            raise ChatError(problem, param="messages")
    voice = preprocessing.get("voice", audio.get("voice"))
    if isinstance(voice, dict):  # OpenAI's custom voice reference: {"id": NAME}
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise ChatError("the voice must be a voice's name", param="audio.voice")
    try:
        voice = voice_name(voice) if voice else None
    except QueryError as error:
        raise ChatError(error.message.replace("voice_prompt", "the voice"),
                        param="audio.voice") from None
    sources = (lm, value)  # stage_params.lm first, then the top level
    call = CallRequest(
        voice=voice, role=defaults.role if role is None else role,
        temp_text=_number(sources, "temperature", defaults.temp_text, MAX_TEMPERATURE),
        top_k_text=_top_k(sources, "top_k", defaults.top_k_text),
        temp_audio=_number(sources, "audio_temperature", defaults.temp_audio,
                           MAX_TEMPERATURE),
        top_k_audio=_top_k(sources, "audio_top_k", defaults.top_k_audio),
        greedy=defaults.greedy,
        seed=_integer(sources, "seed", None, 0, MAX_SEED),
        stats=False, unknown=())
    options = _object(value, "stream_options") or {}
    return ChatRequest(call, recording, sglang, model or MODEL_ID, modalities, audio_format,
                       stream, bool(options.get("include_usage")))


# -- reading a request ---------------------------------------------------------------------

def _object(value: dict, name: str, prefix: str = "") -> dict | None:
    found = value.get(name)
    if found is not None and not isinstance(found, dict):
        raise ChatError(f"{prefix}{name} must be an object", param=prefix + name)
    return found


def _boolean(value: dict, name: str) -> bool:
    found = value.get(name, False)
    if not isinstance(found, bool):
        raise ChatError(f"{name} must be true or false", param=name)
    return found


def _modalities(found) -> tuple[str, ...]:
    if not isinstance(found, list) or not found or \
            any(item not in MODALITIES for item in found):
        raise ChatError('modalities is a list of "text" and "audio"', param="modalities")
    return tuple(dict.fromkeys(found))


def _pick(sources, name: str):
    for source in sources:
        if source.get(name) is not None:
            return source[name]
    return None


def _number(sources, name: str, default: float, high: float) -> float:
    found = _pick(sources, name)
    if found is None:
        return default
    # An integer of any size compares; only a float can be nan or infinite.
    if isinstance(found, bool) or not isinstance(found, (int, float)) or \
            isinstance(found, float) and not math.isfinite(found) or not 0 <= found <= high:
        raise ChatError(f"{name} must be a number from 0 to {high:g}", param=name)
    return float(found)


def _integer(sources, name: str, default, low: int, high: int):
    found = _pick(sources, name)
    if found is None:
        return default
    if isinstance(found, bool) or not isinstance(found, int) or not low <= found <= high:
        raise ChatError(f"{name} must be an integer from {low} to {high}", param=name)
    return found


def _top_k(sources, name: str, default: int) -> int:
    # SGLang-Omni's -1 is "no top-k", as 0 is here.
    found = _integer(sources, name, default, -1, MAX_TOP_K)
    return max(found, 0)


def _text(content, where: str) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and
                                         part.get("type") == "text" and
                                         isinstance(part.get("text"), str)
                                         for part in content):
        return "".join(part["text"] for part in content)
    raise ChatError(f"a {where} message holds text only", param="messages")


def _messages(messages, sglang: bool) -> tuple[str | None, list[dict]]:
    """(the system messages' text or None, the user messages' input_audio parts)."""
    if messages is None and sglang:
        return None, []
    if not isinstance(messages, list):
        raise ChatError("messages must be a list of messages", param="messages")
    system: list[str] = []
    audio: list[dict] = []
    for message in messages:
        if not isinstance(message, dict):
            raise ChatError("each message must be an object", param="messages")
        role, content = message.get("role"), message.get("content")
        if role in ("system", "developer"):
            system.append(_text(content, role))
        elif role == "user":
            parts = content if isinstance(content, list) else [
                {"type": "text", "text": content if isinstance(content, str) else ""}]
            for part in parts:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "input_audio":
                    audio.append(part.get("input_audio"))
                elif kind == "text" and not str(part.get("text") or "").strip():
                    continue
                elif kind == "text":
                    raise ChatError("PersonaPlex hears audio only: the user message's "
                                    "text cannot be answered (send it as speech, or put "
                                    "the role in a system message)", param="messages")
                else:
                    raise ChatError(f"a user message's part of type {str(kind)[:30]!r} is "
                                    "not taken: one input_audio part", param="messages")
        else:
            raise ChatError(f"a message of role {str(role)[:30]!r} is not taken: one "
                            "recording is answered, without earlier turns",
                            param="messages")
    return ("\n".join(system) if system else None), audio


def _openai_audio(parts: list) -> bytes:
    if not parts:
        raise ChatError("no recording: the user message needs one input_audio part "
                        '({"data": base64, "format": "wav"})', param="messages")
    if len(parts) > 1:
        raise ChatError("one recording per request: the user message has "
                        f"{len(parts)} input_audio parts", param="messages")
    part = parts[0]
    if not isinstance(part, dict) or not isinstance(part.get("data"), str):
        raise ChatError("input_audio needs data (base64) and format", param="messages")
    fmt = part.get("format", "wav")
    if fmt not in INPUT_FORMATS:
        raise ChatError(f"input_audio.format {str(fmt)[:20]!r} is not read here: "
                        f"{', '.join(INPUT_FORMATS)}", param="messages")
    data = _base64(part["data"], "input_audio.data")
    return _pcm16_as_wav(data) if fmt == "pcm16" else data


def _sglang_audio(audios, parts: list) -> bytes:
    if parts:
        raise ChatError("give the recording once: in audios or in an input_audio part, "
                        "not both", param="audios")
    if not isinstance(audios, list) or len(audios) != 1 or not isinstance(audios[0], str):
        raise ChatError("audios takes one recording, as a data URI", param="audios")
    uri = audios[0]
    head, comma, data = uri.partition(",")
    if not uri.startswith("data:") or not comma:
        raise ChatError("audios takes data URIs only (data:audio/wav;base64,...): paths "
                        "and URLs are refused, nothing is fetched", param="audios")
    if not head.endswith(";base64"):
        raise ChatError("the data URI must be base64 (data:audio/wav;base64,...)",
                        param="audios")
    recording = _base64(data, "audios[0]")
    media = head[len("data:"):-len(";base64")].lower()
    return _pcm16_as_wav(recording) if media in ("audio/pcm", "audio/l16") else recording


def _base64(text: str, param: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ChatError(f"{param} is not valid base64", param=param) from None
    if not data:
        raise ChatError(f"{param} holds no audio", param=param)
    return data


def _pcm16_as_wav(data: bytes) -> bytes:
    from ..audio.wav import WavWriter

    if len(data) % 2:
        raise ChatError("pcm16 audio has an even number of bytes (16-bit samples)",
                        param="input_audio.data")
    samples = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
    wav = io.BytesIO()
    writer = WavWriter(wav, SAMPLE_RATE, 1, "s16", num_frames=len(samples))
    writer.write(samples)
    writer.close()
    return wav.getvalue()


# -- the answer ----------------------------------------------------------------------------

def encode_audio(pcm: np.ndarray, audio_format: str) -> bytes:
    """The answer's samples (float, 24 kHz mono) in `audio_format`."""
    from ..audio.writers import open_writer

    out = io.BytesIO()
    writer = open_writer(out, OUTPUT_FORMATS[audio_format], SAMPLE_RATE, 1,
                         num_frames=len(pcm))
    writer.write(pcm)
    writer.close()
    return out.getvalue()


def usage(frames: int) -> dict:
    """Frames heard and frames said (one each per 80 ms), as OpenAI counts tokens."""
    return {"prompt_tokens": frames, "completion_tokens": frames,
            "total_tokens": 2 * frames,
            "prompt_tokens_details": {"audio_tokens": frames, "text_tokens": 0},
            "completion_tokens_details": {"audio_tokens": frames, "text_tokens": 0}}


class Completion:
    """One request's answer: `whole`, or as server-sent events (`opening`, a `frame` per
    80 ms, `closing`)."""

    def __init__(self, request: ChatRequest, created: int):
        self.request = request
        self.created = created
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.audio_id = "audio_" + uuid.uuid4().hex

    @property
    def speaks(self) -> bool:
        return "audio" in self.request.modalities

    def whole(self, pcm: np.ndarray, pieces: list[str]) -> dict:
        text = spoken(pieces)
        message: dict = {"role": "assistant"}
        if self.request.sglang:
            if "text" in self.request.modalities:
                message["content"] = text
            if self.speaks:
                message["audio"] = {"id": self.audio_id, "transcript": text,
                                    "data": self._base64(pcm)}
            return self._envelope("chat.completion", message, "message", "stop",
                                  usage=usage(len(pieces)))
        # OpenAI's: with audio, the text is its transcript and content is null.
        message.update(content=None if self.speaks else text, refusal=None)
        if self.speaks:
            message["audio"] = {"id": self.audio_id, "data": self._base64(pcm),
                                "expires_at": self.created, "transcript": text}
        return self._envelope("chat.completion", message, "message", "stop",
                              usage=usage(len(pieces)))

    def _base64(self, pcm: np.ndarray) -> str:
        return base64.b64encode(encode_audio(pcm, self.request.audio_format)).decode("ascii")

    def _envelope(self, kind: str, body: dict, key: str, finish: str | None,
                  usage: dict | None = None) -> dict:
        value = {"id": self.id, "object": kind, "created": self.created,
                 "model": self.request.model,
                 "choices": [{"index": 0, key: body, "finish_reason": finish,
                              "logprobs": None}]}
        if usage is not None:
            value["usage"] = usage
        return value

    # -- server-sent events -----------------------------------------------------------------

    @staticmethod
    def event(value: dict) -> bytes:
        return b"data: " + json.dumps(value).encode() + b"\n\n"

    def opening(self) -> bytes:
        return self.event(self._envelope("chat.completion.chunk", {"role": "assistant"},
                                         "delta", None))

    def frame(self, pcm: np.ndarray, piece: str) -> bytes:
        """One 80 ms frame of the answer as it is computed (b'' when it carries nothing
        asked for: a silent frame of a text-only answer)."""
        from ..audio.wav import encode_samples

        delta: dict = {}
        text = piece if piece not in SILENT else ""
        if self.speaks:
            audio = {"id": self.audio_id,
                     "data": base64.b64encode(encode_samples(pcm, 1, "s16")).decode("ascii")}
            if not self.request.sglang and text:
                audio["transcript"] = text
            delta["audio"] = audio
        if text and (self.request.sglang and "text" in self.request.modalities
                     or not self.speaks):
            delta["content"] = text
        if not delta:
            return b""
        return self.event(self._envelope("chat.completion.chunk", delta, "delta", None))

    def closing(self, frames: int) -> bytes:
        events = []
        if self.speaks and not self.request.sglang:  # the last audio update: its expiry
            events.append(self.event(self._envelope(
                "chat.completion.chunk",
                {"audio": {"id": self.audio_id, "expires_at": self.created}}, "delta",
                None)))
        events.append(self.event(self._envelope("chat.completion.chunk", {}, "delta",
                                                "stop")))
        if self.request.include_usage:
            events.append(self.event({"id": self.id, "object": "chat.completion.chunk",
                                      "created": self.created, "model": self.request.model,
                                      "choices": [], "usage": usage(frames)}))
        return b"".join(events) + DONE

    @staticmethod
    def failure(status: int, message: str) -> bytes:
        """An error after the stream began: its last event."""
        return b"data: " + error_body(status, message) + b"\n\n" + DONE
