"""`personaplex serve` speaks OpenAI's audio chat: `POST /v1/chat/completions` and
`GET /v1/models`, through the `openai` package's own client, unchanged, pointed at the
server's base URL; SGLang-Omni's request shape through plain HTTP.

One server runs in this process on the golden tiny checkpoints for every case. The answer
is `reply`'s on the same recording, persona and seed (its frames are the same engine's), so
`reply` run as a command is the reference.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import golden_model_folder
from serve_clients import serving

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

ROLE = "Be brief."
SEED = 1234
SECONDS = 2.3  # not a whole number of 80 ms frames: the answer is trimmed to it
QUESTION = Path(__file__).parents[1] / "personaplex_cli" / "samples" / "question.wav"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return golden_model_folder(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """(base URL, the Server) of a server on a thread, for the whole module."""
    from personaplex_cli.serve.access import Access, Hosts

    with serving(model_dir, tmp_path_factory.mktemp("chat-cache"),
                 Access(None, (), 0, Hosts.serving("127.0.0.1")), role=ROLE,
                 max_sessions=2) as (url, server, lines):
        yield url, server, lines


def client(served, **kwargs):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="anything", max_retries=0,
                         timeout=120, **kwargs)


@pytest.fixture(scope="module")
def recording() -> bytes:
    """The first seconds of the packaged question, as a WAV file's bytes."""
    pcm, rate = sf.read(QUESTION, dtype="float32")
    data = io.BytesIO()
    sf.write(data, pcm[:int(SECONDS * rate)], rate, format="WAV", subtype="PCM_16")
    return data.getvalue()


@pytest.fixture(scope="module")
def reference(run_cli, model_dir, recording, tmp_path_factory):
    """`reply` on the recording, persona and seed: (samples as float, frame pieces)."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "in.wav").write_bytes(recording)
    env = {"PERSONAPLEX_MODEL": model_dir, "PERSONAPLEX_DEVICE": "cpu"}
    proc = run_cli("reply", folder / "in.wav", folder / "out.wav", "--voice", "NATF2",
                   "--prompt", ROLE, "--seed", SEED, "--text-out", folder / "out.json",
                   env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    pcm, _ = sf.read(folder / "out.wav", dtype="float32")
    return pcm, json.loads((folder / "out.json").read_text())


def openai_messages(recording: bytes, fmt: str = "wav") -> list[dict]:
    return [{"role": "system", "content": ROLE},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {
                "data": base64.b64encode(recording).decode(), "format": fmt}}]}]


def spoken(pieces: list[str]) -> str:
    return "".join(p for p in pieces if p not in ("PAD", "EPAD")).strip()


def post(served, body, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(served[0] + "/v1/chat/completions", data=data,
                                     method="POST", headers={
                                         "Content-Type": "application/json",
                                         **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_free(server, timeout: float = 10.0) -> None:
    switchboard = server.switchboard
    deadline = time.monotonic() + timeout
    while (switchboard.seats or switchboard.scheduler.live()) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    assert switchboard.seats == 0 and not switchboard.scheduler.live()


# -- GET /v1/models ----------------------------------------------------------------------------

def test_models_list_the_served_model_and_its_alias(served):
    ids = [model.id for model in client(served).models.list()]
    assert ids == ["personaplex-7b-v1", "personaplex"]


# -- OpenAI's shape, through the SDK -----------------------------------------------------------

def test_openai_sdk_answer_is_reply(served, recording, reference):
    """client.chat.completions.create with audio in and out: the answer's audio and
    transcript are `reply`'s on the same recording, persona and seed."""
    pcm, pieces = reference
    answer = client(served).chat.completions.create(
        model="personaplex-7b-v1", modalities=["text", "audio"],
        audio={"voice": "NATF2", "format": "wav"}, seed=SEED,
        messages=openai_messages(recording))
    message = answer.choices[0].message
    assert message.content is None and answer.choices[0].finish_reason == "stop"
    assert message.audio.id and message.audio.expires_at == answer.created
    got, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    assert rate == 24000 and len(got) == len(pcm) == int(SECONDS * 24000)
    assert np.max(np.abs(got - pcm)) <= 1.5 / 32768
    assert message.audio.transcript == spoken(pieces)
    frames = len(pieces)
    assert answer.usage.prompt_tokens == answer.usage.completion_tokens == frames
    assert answer.model == "personaplex-7b-v1"

    # Another seed, another answer: the seed reached the engine.
    other = client(served).chat.completions.create(
        model="personaplex", modalities=["text", "audio"],
        audio={"voice": "NATF2", "format": "pcm16"}, seed=SEED + 1,
        messages=openai_messages(recording))
    other_pcm = np.frombuffer(base64.b64decode(other.choices[0].message.audio.data), "<i2")
    assert len(other_pcm) == len(pcm)
    assert np.max(np.abs(other_pcm / 32767.0 - pcm)) > 0.01
    wait_free(served[1])


def test_openai_sdk_stream_is_the_answer_in_frames(served, recording, reference):
    """stream=True: server-sent events, one 80 ms piece of PCM16 each as the engine computes
    it; together they are the whole answer, and the transcript pieces its transcript."""
    pcm, pieces = reference
    stream = client(served).chat.completions.create(
        model="personaplex-7b-v1", modalities=["text", "audio"],
        audio={"voice": "NATF2", "format": "pcm16"}, seed=SEED, stream=True,
        stream_options={"include_usage": True}, messages=openai_messages(recording))
    audio, transcript, expiry, arrivals, usage = [], [], None, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            got = delta.get("audio") or {}
            if got.get("data"):
                audio.append(base64.b64decode(got["data"]))
                arrivals.append(time.monotonic())
            transcript.append(got.get("transcript") or "")
            expiry = got.get("expires_at") or expiry
    samples = np.frombuffer(b"".join(audio), "<i2") / 32767.0
    assert len(audio) == len(pieces)  # a piece per frame
    assert all(len(piece) == 3840 for piece in audio[:-1])  # 1920 samples of 16 bits
    assert len(audio[-1]) == 2 * (len(pcm) - 1920 * (len(pieces) - 1))  # the last, trimmed
    assert np.max(np.abs(samples - pcm)) <= 1.5 / 32768
    assert "".join(transcript).strip() == spoken(pieces)
    assert expiry and usage.completion_tokens == len(pieces)
    wait_free(served[1])


def test_text_only_modality_answers_the_transcript(served, recording, reference):
    answer = client(served).chat.completions.create(
        model="personaplex", modalities=["text"], seed=SEED,
        messages=openai_messages(recording))
    assert answer.choices[0].message.content == spoken(reference[1])
    assert answer.choices[0].message.audio is None


# -- SGLang-Omni's shape ----------------------------------------------------------------------

def test_sglang_shape_answer_is_reply(served, recording, reference):
    """audios as a data URI and stage_params (through plain HTTP, and through the SDK's
    extra_body): the same answer, in SGLang-Omni's shape (content is the text)."""
    pcm, pieces = reference
    body = {"model": "personaplex", "messages": [],
            "audios": ["data:audio/wav;base64," + base64.b64encode(recording).decode()],
            "modalities": ["text", "audio"],
            "stage_params": {"preprocessing": {"voice": "NATF2", "text_prompt": ROLE},
                             "lm": {"seed": SEED, "audio_temperature": 0.8,
                                    "audio_top_k": 250}}}
    status, answer = post(served, body)
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert message["content"] == spoken(pieces) == message["audio"]["transcript"]
    assert "expires_at" not in message["audio"]
    got, _ = sf.read(io.BytesIO(base64.b64decode(message["audio"]["data"])), dtype="float32")
    assert np.max(np.abs(got - pcm)) <= 1.5 / 32768
    assert answer["usage"]["total_tokens"] == 2 * len(pieces)

    # Streamed in SGLang-Omni's shape: the text pieces as content, the audio without them.
    request = urllib.request.Request(served[0] + "/v1/chat/completions", method="POST",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [line[6:] for line in response.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    streamed = b"".join(base64.b64decode(d["audio"]["data"]) for d in deltas if "audio" in d)
    assert np.max(np.abs(np.frombuffer(streamed, "<i2") / 32767.0 - pcm)) <= 1.5 / 32768
    assert "".join(d.get("content", "") for d in deltas).strip() == spoken(pieces)
    assert not any("transcript" in d.get("audio", {}) for d in deltas)

    extra = {key: body[key] for key in ("audios", "stage_params")}
    via_sdk = client(served).chat.completions.create(
        model="personaplex", messages=[{"role": "user", "content": ""}],
        extra_body=extra)
    assert via_sdk.choices[0].message.content == spoken(pieces)


# -- refusals and limits -----------------------------------------------------------------------

def test_refusals_in_openai_error_json(served, recording):
    """Each bad request gets OpenAI's error JSON with the right status and field, and the
    server fetches nothing."""
    audio = base64.b64encode(recording).decode()
    good = {"model": "personaplex", "messages": openai_messages(recording)}
    cases = [
        ({"model": "personaplex", "audios": ["https://example.com/a.wav"]}, 400, "audios"),
        ({"model": "personaplex", "audios": ["/etc/passwd"]}, 400, "audios"),
        ({"model": "personaplex", "audios": ["file:///etc/passwd"]}, 400, "audios"),
        ({"model": "personaplex", "audios": ["data:audio/wav;base64,%%%not base64"]}, 400,
         "audios[0]"),
        ({**good, "messages": [{"role": "user", "content": [{"type": "input_audio",
          "input_audio": {"data": "not base64!", "format": "wav"}}]}]}, 400,
         "input_audio.data"),
        ({**good, "audio": {"voice": "alloy", "format": "wav"}}, 400, None),
        ({**good, "audio": {"voice": "../NATF2", "format": "wav"}}, 400, "audio.voice"),
        ({**good, "audio": {"voice": "NATF2", "format": "mp3"}}, 400, "audio.format"),
        ({**good, "model": "gpt-4o-audio-preview"}, 404, "model"),
        ({**good, "messages": [{"role": "system", "content": ROLE}]}, 400, "messages"),
        ({**good, "messages": [{"role": "user", "content": "What time is it?"}]}, 400,
         "messages"),
        ({**good, "stream": True, "audio": {"voice": "NATF2", "format": "wav"}}, 400,
         "audio.format"),
        ({**good, "temperature": -1}, 400, "temperature"),
        ({**good, "seed": "seven"}, 400, "seed"),
        ({**good, "messages": openai_messages(b"RIFF\x00\x00\x00\x00WAVEjunk")}, 400, None),
        (b"{not json", 400, None),
    ]
    for body, status, param in cases:
        got, answer = post(served, body)
        assert got == status, (body if isinstance(body, bytes) else list(body), answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert answer["error"]["param"] == param, answer
    got, answer = post(served, {**good, "audio": {"voice": "alloy", "format": "wav"}})
    assert "unknown voice 'alloy'" in answer["error"]["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client(served).chat.completions.create(model="whisper-1",
                                               messages=openai_messages(recording))
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client(served).chat.completions.create(model="personaplex", messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {
                "data": audio, "format": "wav"}}] * 2}])
    wait_free(served[1])


def test_limits_are_reply_s(served, recording, monkeypatch):
    """The same limits as POST /api/reply: a declared length over the limit before the
    body, a recording over 600 s, no free slot, the token; each in OpenAI's error JSON, as
    the SDK reads them."""
    import http.client

    from personaplex_cli.serve import switchboard as switchboards

    port = int(served[0].rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(switchboards.MAX_REPLY_BYTES + 1))
    connection.endheaders()  # no body: a server that waited for it would time out
    response = connection.getresponse()
    assert response.status == 413 and "over the limit" in json.loads(
        response.read())["error"]["message"]
    connection.close()

    # A FLAC that declares no length: decoding stops at 600 s, as for /api/reply.
    from test_serve import lengthless_flac

    status, answer = post(served, {"model": "personaplex", "messages": openai_messages(
        lengthless_flac(700.0), "flac")})
    assert status == 413 and "600 s" in answer["error"]["message"], answer

    switchboard = served[1].switchboard
    monkeypatch.setattr(switchboard.scheduler, "seats", switchboard.capacity)
    with pytest.raises(openai.InternalServerError) as caught:
        client(served).chat.completions.create(model="personaplex",
                                               messages=openai_messages(recording))
    assert caught.value.status_code == 503 and "taken" in caught.value.message
    monkeypatch.setattr(switchboard.scheduler, "seats", 0)

    monkeypatch.setattr(switchboard.access, "token", "s3cret")
    with pytest.raises(openai.AuthenticationError):
        client(served).models.list()
    with pytest.raises(openai.AuthenticationError):
        client(served).chat.completions.create(model="personaplex",
                                               messages=openai_messages(recording))
    allowed = openai.OpenAI(base_url=served[0] + "/v1", api_key="s3cret", max_retries=0)
    assert [m.id for m in allowed.models.list()][0] == "personaplex-7b-v1"


def test_a_stream_whose_client_goes_frees_its_slot(served):
    """A long recording streamed: when the client stops reading and goes, the engine stops
    stepping it and the seat is free."""
    import socket

    data = io.BytesIO()
    pcm, rate = sf.read(QUESTION, dtype="float32")
    sf.write(data, np.tile(pcm, 40)[:rate * 120], rate, format="WAV", subtype="PCM_16")
    body = json.dumps({"model": "personaplex", "stream": True,
                       "audio": {"voice": "NATF2", "format": "pcm16"},
                       "messages": openai_messages(data.getvalue())}).encode()
    port = int(served[0].rsplit(":", 1)[1])
    switchboard = served[1].switchboard
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
        while head.count(b"data: ") < 3:
            head += sock.recv(65536)
        assert switchboard.scheduler.live()
    gone = time.monotonic()
    wait_free(served[1])
    print(f"slot free {time.monotonic() - gone:.2f} s after the client went")
    assert time.monotonic() - gone < 5.0


def test_an_async_client_too(served, recording, reference):
    """The SDK's async client, two requests at once: each its own answer, in its own slot."""

    async def both():
        async with openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="x",
                                      max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*[aclient.chat.completions.create(
                model="personaplex", modalities=["text", "audio"], seed=seed,
                audio={"voice": "NATF2", "format": "wav"},
                messages=openai_messages(recording)) for seed in (SEED, SEED + 1)])

    first, second = asyncio.run(both())
    assert first.choices[0].message.audio.transcript == spoken(reference[1])
    assert first.choices[0].message.audio.data != second.choices[0].message.audio.data


def test_a_stream_cut_short_ends_with_an_error_event(served):
    """When the server must end a streamed answer (as at shutdown), the stream's last event
    is OpenAI's error JSON, which the SDK raises, and the slot is free."""
    from personaplex_cli.serve.switchboard import SHUTTING_DOWN, ServerClosing

    data = io.BytesIO()
    pcm, rate = sf.read(QUESTION, dtype="float32")
    sf.write(data, np.tile(pcm, 12), rate, format="WAV", subtype="PCM_16")
    switchboard = served[1].switchboard
    stream = client(served).chat.completions.create(
        model="personaplex", stream=True, audio={"voice": "NATF2", "format": "pcm16"},
        messages=openai_messages(data.getvalue()))
    chunks = 0
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            chunks += 1
            if chunks == 3:  # what shutdown does to the answers in the engine
                switchboard.loop.call_soon_threadsafe(lambda: [
                    reply.set_exception(ServerClosing(SHUTTING_DOWN))
                    for reply in switchboard._replies if not reply.done()])
    assert SHUTTING_DOWN in str(caught.value.message) and chunks < 100
    wait_free(served[1])


def test_a_stream_nobody_reads_is_cut_and_holds_its_seat_until_then(served, monkeypatch):
    """A streamed answer whose client never reads (issue 30.2): its seat and its client's
    count are held until the stream ends (before, they were freed once the engine had
    finished, while the frames waited for good), and it is cut: at once when its frames
    waiting pass the stream's buffer, else at --idle-timeout (4 s here) once its writing
    has waited that long (the event saying why cannot reach it)."""
    import hostile_clients as hostile

    from personaplex_cli.serve import switchboard as switchboards

    switchboard = served[1].switchboard
    recording = hostile.speech_flac(30.0)  # 375 frames: the engine has them in seconds
    host, port = "127.0.0.1", int(served[0].rsplit(":", 1)[1])
    body = hostile.stream_request(recording)

    def unread() -> tuple[float | None, list[int], float | None]:
        """-> (seconds until the server cut it, the seats taken meanwhile, seconds until
        the log said it was cut for its buffer)."""
        import socket

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, port))
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        began, seats, logged = time.monotonic(), [], None
        said = sum("cut: its client read over" in line for line in served[2])
        try:
            while time.monotonic() - began < 15:
                time.sleep(0.1)
                seats.append(switchboard.seats)
                if logged is None and sum("cut: its client read over" in line
                                          for line in served[2]) > said:
                    logged = time.monotonic() - began
                if hostile._peer_closed(sock):
                    return time.monotonic() - began, seats, logged
            return None, seats, logged
        finally:
            sock.close()

    cut_after, seats, logged = unread()  # its buffer of 750 frames is never full
    print(f"a stream nobody reads: cut after {cut_after} s; seats {seats[::10]}")
    assert logged is None
    assert cut_after is not None and 4.0 <= cut_after < 4.0 + 6.0, cut_after
    assert min(seats[5:-1]) == 1, seats  # held from the answer's start to the cut
    wait_free(served[1])

    monkeypatch.setattr(switchboards, "STREAM_BUFFER_FRAMES", 20)
    cut_after, seats, logged = unread()  # 20 frames waiting: its work and frames go at once
    print(f"with a buffer of 20 frames: cut for it after {logged} s, the connection after "
          f"{cut_after} s")
    # Both start once its writing waits: the buffer fills in frames, the timer in 4 s.
    assert logged is not None and cut_after is not None, (logged, cut_after)
    assert logged < cut_after - 2.0, (logged, cut_after)
    wait_free(served[1])


def test_odd_bodies_are_400_in_openai_json(served, recording):
    """What was a plain-text 500 "Internal Server Error" (issue 30.4): deeply nested JSON,
    `audio.format: []`, a temperature of 400 digits, a system prompt that is not UTF-8 text
    (JSON's escape of half a character). And whatever shape each field has, parse_chat
    raises ChatError only."""
    from personaplex_cli.serve.chat import ChatError, parse_chat
    from personaplex_cli.serve.query import Defaults

    good = {"model": "personaplex", "messages": openai_messages(recording)}
    odd = [(b"[" * 100_000, None),
           ({**good, "audio": {"format": []}}, "audio.format"),
           (json.dumps(good)[:-1].encode() + b', "temperature": ' + b"9" * 400 + b"}",
            "temperature"),
           ({**good, "messages": [{"role": "system", "content": "caf\udce9"}] +
             good["messages"][1:]}, "messages")]
    for body, param in odd:
        status, answer = post(served, body)
        assert status == 400 and answer["error"]["param"] == param, answer
    assert "not UTF-8" in answer["error"]["message"]

    defaults = Defaults(voice="NATF2", role=ROLE)
    values = [5, -1, 1.5, 10 ** 400, True, None, "x", [], [[]], {}, {"a": []}, "\udce9"]
    fields = ["model", "n", "stream", "modalities", "audio", "temperature", "top_k", "seed",
              "audio_temperature", "audio_top_k", "stage_params", "stream_options",
              "messages", "audios", "tools"]
    nested = [("audio", "format"), ("audio", "voice"), ("stage_params", "lm"),
              ("stage_params", "preprocessing"), ("stream_options", "include_usage")]
    tried = 0
    for value in values:
        bodies = [{**good, name: value} for name in fields]
        bodies += [{**good, outer: {inner: value}} for outer, inner in nested]
        bodies += [{**good, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": value, "format": value}}]}]},
                   {**good, "messages": [value]},
                   {**good, "messages": [{"role": value, "content": value}]}]
        for body in bodies:
            try:
                parse_chat(json.dumps(body).encode(), defaults)
            except ChatError:
                pass
            tried += 1
    print(f"{tried} odd bodies: ChatError or an answer, nothing else")


def test_v1_routes_name_the_bearer_header_and_take_json_only(served, recording, monkeypatch):
    """Every /v1 401 names the Bearer header (the SDK's api_key) rather than ?token=, and
    /v1/chat/completions takes ?token= as the other routes do (issue 30.9); a body that
    does not say it is JSON is refused before it is read (415, issue 30.11)."""
    import websockets

    switchboard = served[1].switchboard
    monkeypatch.setattr(switchboard.access, "token", "s3cret")
    body = {"model": "personaplex", "messages": openai_messages(recording)}
    for path in ("/v1/models", "/v1/chat/completions"):
        request = urllib.request.Request(served[0] + path, data=json.dumps(body).encode()
                                         if "chat" in path else None,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        message = json.loads(refused.value.read())["error"]["message"]
        assert refused.value.code == 401 and "Authorization: Bearer" in message, message

    async def realtime():
        url = "ws" + served[0][4:] + "/v1/realtime?model=personaplex"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url):
                pass
        return refused.value.response

    response = asyncio.run(realtime())
    assert response.status_code == 401 and b"Authorization: Bearer" in response.body
    status, answer = post(served, body, {"Authorization": "Bearer s3cret"})
    assert status == 200, answer
    request = urllib.request.Request(served[0] + "/v1/chat/completions?token=s3cret",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200 and json.loads(response.read())["choices"]
    monkeypatch.setattr(switchboard.access, "token", None)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
        status, answer = post(served, body, {"Content-Type": content_type})
        assert status == 415 and "application/json" in answer["error"]["message"], answer
    status, _ = post(served, body, {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200
    wait_free(served[1])
