"""`GET /v1/realtime`: OpenAI's Realtime API on `personaplex serve`, through the `openai`
package's own client (AsyncOpenAI(base_url=...).realtime.connect), unchanged.

One server runs in this process for the module (test_serve's fixture: the golden tiny
checkpoints, `slots.step` tapped to see what the engine stepped for each slot). The
exactness test holds the server's deltas against `reply` run on what the engine heard.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import soundfile as sf

from conftest import speech_like
from test_serve import ROLE, model_dir, served  # noqa: F401 - the shared server's fixtures

from personaplex_cli.audio import telephony
from personaplex_cli.serve import realtime
from personaplex_cli.serve.openai_models import MODEL_ID

from openai import AsyncOpenAI  # the test extra's: the client under test

FRAME = 1920
SILENT = ("PAD", "EPAD")


def pcm16(pcm: np.ndarray) -> np.ndarray:
    return np.clip(np.round(pcm * 32768), -32768, 32767).astype("<i2")


@dataclass
class Heard:
    """What a caller got: every event (raw JSON), and when."""

    events: list = field(default_factory=list)
    times: list = field(default_factory=list)
    close_code: int | None = None

    def of(self, *kinds: str) -> list[dict]:
        return [e for e in self.events if e["type"] in kinds]

    def responses(self, delta: str = "response.output_audio.delta",
                  transcript: str = "response.output_audio_transcript.delta") -> list[dict]:
        """Each response: its start frame, audio deltas (bytes), transcript deltas, status."""
        found = {}
        for event in self.events:
            kind = event["type"]
            if kind == "response.created":
                response = event["response"]
                found[response["id"]] = {"start": int(response["metadata"]["start_frame"]),
                                         "audio": [], "text": [], "status": None}
            elif kind == delta:
                found[event["response_id"]]["audio"].append(base64.b64decode(event["delta"]))
            elif kind == transcript:
                found[event["response_id"]]["text"].append(event["delta"])
            elif kind == "response.done":
                found[event["response"]["id"]]["status"] = event["response"]["status"]
        return list(found.values())


def client(served) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=served.url + "/v1", api_key="any key: the server has none")


async def hold_call(served, pcm: np.ndarray | None, *, session: dict | None = None,
                    lead_frames: int = 2, linger_s: float = 1.0, wait_updated: bool = True,
                    model: str = MODEL_ID, headers: dict | None = None,
                    events: list[dict] | None = None, opening: list[dict] = (),
                    wire=pcm16, frame_bytes=None, during=None) -> Heard:
    """One caller through the SDK: the `opening` events and session.update (if given);
    once primed, `events`, then `pcm` in 80 ms frames at real-time pace (`lead_frames`
    ahead); reads every event until `linger_s` after the last audio. `during(connection,
    heard)` runs beside, from the events on."""
    heard = Heard()
    async with client(served).realtime.connect(model=model,
                                               extra_headers=headers or {}) as connection:
        async def read():
            from websockets.exceptions import ConnectionClosed

            try:
                while True:
                    heard.events.append(json.loads(await connection.recv_bytes()))
                    heard.times.append(time.monotonic())
            except ConnectionClosed as closed:
                heard.close_code = closed.rcvd.code if closed.rcvd else None

        reader = asyncio.create_task(read())
        for event in opening:
            await connection.send(event)
        if session is not None:
            await connection.send({"type": "session.update", "session": session})
        if wait_updated:
            while not heard.of("session.updated") and not reader.done():
                await asyncio.sleep(0.01)
        for event in events or []:
            await connection.send(event)
        beside = asyncio.create_task(during(connection, heard)) if during else None
        if pcm is not None:
            data = wire(pcm).tobytes()
            step = frame_bytes or 2 * FRAME
            began = time.monotonic()
            for k in range(len(data) // step):
                wait = began + (k - lead_frames) * 0.08 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await connection.input_audio_buffer.append(
                    audio=base64.b64encode(data[k * step:(k + 1) * step]).decode())
        await asyncio.sleep(linger_s)
        if beside is not None:
            await beside
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    return heard


def stepped_as_sent(stepped: np.ndarray, sent: np.ndarray) -> tuple[int, int]:
    """Checks that the engine stepped the caller's frames as sent, in order, whole: before
    the first, silence (the ticks before it came); after it, each frame stepped is the
    next sent one, or silence (a tick whose frame was late), or a sent one further on (the
    frames between were dropped by the input queue). -> (late ticks, frames dropped)."""
    begin = int(np.argmax(np.abs(stepped).max(axis=1) > 0))
    assert not stepped[:begin].any()
    late = dropped = 0
    following = 0
    for frame in stepped[begin:]:
        if not frame.any():
            late += 1
            continue
        match = next((j for j in range(following, len(sent))
                      if np.array_equal(frame, sent[j])), None)
        assert match is not None, "the engine stepped a frame the caller never sent"
        dropped += match - following
        following = match + 1
    return late, dropped + len(sent) - following


def fresh_steps(served) -> None:
    """Once no row of an earlier test is on the engine, forgets the steps tapped so far: a
    slot's steps from then on are one call's."""
    switchboard = served.server.switchboard
    began = time.monotonic()
    while (switchboard.seats or switchboard.scheduler.live()) and \
            time.monotonic() - began < 20:
        time.sleep(0.02)
    served.steps.clear()


def left(call) -> None:
    """Waits until the engine has let the call's row go: its figures and the steps tapped
    are then final."""
    began = time.monotonic()
    while call.row.live and time.monotonic() - began < 10:
        time.sleep(0.02)
    assert not call.row.live


def live_call(served, session_id: str):
    for call in served.server.switchboard.sessions:
        if isinstance(call, realtime.RealtimeCall) and \
                call.session.describe()["id"] == session_id:
            return call
    return None


# -- without a server ------------------------------------------------------------------------

def test_g711_is_the_standard():
    """μ-law and A-law, both ways, over every 16-bit sample and every code: the tables
    Python's audioop (CPython 3.11) gives, by their sha256."""
    samples = np.arange(-32768, 32768, dtype=np.int16)
    codes = np.arange(256, dtype=np.uint8)
    digests = [hashlib.sha256(data).hexdigest() for data in (
        telephony.ulaw_encode(samples).tobytes(), telephony.alaw_encode(samples).tobytes(),
        telephony.ulaw_decode(codes).astype("<i2").tobytes(),
        telephony.alaw_decode(codes).astype("<i2").tobytes())]
    assert digests == [
        "81d633c9e6972a18c74a58720b96cb8ca0bdd096d4060b646dd708c3b846019a",
        "38488f6fd710f4686360edc4d38639f96c491595ef93f8eb8d62d5e07ca6ce7b",
        "3dab54339e520bb2c924826e3b72a917a2b612e9fd12fc867500f1d983a75827",
        "e04788d110e58ff8c70c93b8480190d973e3b67876b6119abbaec766cc75c174"]


def known_turns(rate: int = 24000) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """Speech at 1.0-3.0 s and 4.5-6.0 s, digital silence around it, 7.2 s in all."""
    pcm = np.zeros(int(7.2 * rate), np.float32)
    for start, end, seed in ((1.0, 3.0, 1), (4.5, 6.0, 2)):
        a, b = int(start * rate), int(end * rate)
        pcm[a:b] = speech_like(end - start, rate, seed=seed)[:b - a]
    return pcm, [("started", 1000), ("stopped", 3000), ("started", 4500), ("stopped", 6000)]


def test_speech_detector_on_known_times():
    pcm, expected = known_turns()
    detector = realtime.SpeechDetector()
    turns = [t for frame in pcm.reshape(-1, FRAME) for t in detector.push(frame)]
    assert [kind for kind, _ in turns] == [kind for kind, _ in expected]
    for (_, got), (_, want) in zip(turns, expected):
        assert abs(got - want) <= 100, (turns, expected)


def test_responses_follow_the_models_speech():
    """A response opens at the first frame with a piece or audible audio, sends every frame
    until END_QUIET_FRAMES quiet ones, and is `cancelled` when talked over or cancelled;
    a cancelled stretch stays off the wire until it ends."""
    events = []
    numbers = iter(range(1000))
    responses = realtime.Responses(lambda kind, **f: events.append((kind, f)),
                                   lambda kind: f"{kind}{next(numbers)}", lambda: {},
                                   "output_audio")
    loud = np.full(FRAME, 0.1, np.float32)
    quiet = np.zeros(FRAME, np.float32)
    frames = [(quiet, "PAD")] * 3 + [(quiet, " Hi"), (loud, "PAD")] + \
        [(quiet, "PAD")] * realtime.END_QUIET_FRAMES + [(quiet, "EPAD")] * 2
    for index, (pcm, piece) in enumerate(frames):
        responses.frame(index, pcm, piece, lambda p: "x")
    kinds = [kind for kind, _ in events]
    assert kinds.count("response.output_audio.delta") == 2 + realtime.END_QUIET_FRAMES
    assert [f["delta"] for k, f in events if k.endswith("transcript.delta")] == [" Hi"]
    done = [f for k, f in events if k == "response.done"]
    assert done[0]["response"]["status"] == "completed"
    assert done[0]["response"]["metadata"] == {"start_frame": "3"}
    assert kinds[-1] == "response.done" and kinds[:4] == [
        "response.created", "response.output_item.added", "conversation.item.added",
        "response.content_part.added"]
    assert kinds[-6:-1] == ["response.output_audio.done", "response.output_audio_transcript.done",
                            "response.content_part.done", "response.output_item.done",
                            "conversation.item.done"]
    # talked over, then the model stopped: cancelled (turn_detected)
    events.clear()
    responses.frame(20, loud, "PAD", str)
    responses.talked_over()
    for index in range(realtime.END_QUIET_FRAMES):
        responses.frame(21 + index, quiet, "PAD", str)
    done = [f for k, f in events if k == "response.done"][0]["response"]
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")
    # response.cancel: done at once, the rest of the stretch unsent, the next one sent
    events.clear()
    responses.frame(40, loud, " a", str)
    assert responses.cancel() and not responses.cancel()
    for index in range(5):
        responses.frame(41 + index, loud, " b", str)
    assert [k for k, _ in events].count("response.output_audio.delta") == 1
    for index in range(realtime.END_QUIET_FRAMES):
        responses.frame(46 + index, quiet, "PAD", str)
    responses.frame(60, loud, " c", str)
    assert [k for k, _ in events].count("response.created") == 2


# -- against the server ------------------------------------------------------------------------

def test_the_sdk_holds_two_calls_and_the_audio_is_replys(served, run_cli, model_dir, tmp_path):
    """Two callers at once through the SDK, unchanged: session.update with instructions and
    a voice, 10 s of speech appended in real time, audio deltas and transcript back. For the
    first, EXACTNESS: the engine stepped exactly the PCM16 it appended (after the ticks
    before its first frame), and its audio deltas, with the gaps between responses filled
    by the frames the model produced there, are `reply` on that input with the same persona
    and seed, to PCM16's rounding; its transcript deltas are reply's pieces."""
    fresh_steps(served)
    seconds = 10.0
    pcm = [speech_like(seconds, seed=seed) for seed in (5, 6)]
    sessions = [{"type": "realtime", "instructions": ROLE,
                 "audio": {"output": {"voice": "NATF2"}}, "personaplex": {"seed": 7}},
                {"type": "realtime", "instructions": "You are a pirate.",
                 "audio": {"output": {"voice": "NATF2"}}, "temperature": 0.9}]
    seen = {}

    async def watch(connection, heard):
        while True:  # the call's server side, while it lasts
            created = heard.of("session.created")
            call = created and live_call(served, created[0]["session"]["id"])
            if call:
                seen.setdefault(call.session.request.role, call)
                return
            await asyncio.sleep(0.05)

    async def both():
        return await asyncio.gather(*(hold_call(served, p, session=s, during=watch)
                                      for p, s in zip(pcm, sessions)))

    first, second = asyncio.run(both())
    for heard in (first, second):
        assert not heard.of("error"), heard.of("error")
        assert [e["type"] for e in heard.events[:1]] == ["session.created"]
        assert heard.of("session.updated")
        assert heard.of("response.output_audio.delta")
        assert heard.of("response.output_audio_transcript.delta")
    assert second.of("session.updated")[0]["session"]["instructions"] == "You are a pirate."

    call = seen[ROLE]
    left(call)
    slot = call.row.slot
    heard_in = np.stack([step_in[slot] for live, step_in, _ in served.steps if slot in live])
    said = np.stack([out[slot] for live, _, out in served.steps if slot in live])
    sent = (pcm16(pcm[0]).astype(np.float32) / 32768)[:len(pcm[0]) // FRAME * FRAME]
    late, dropped = stepped_as_sent(heard_in, sent.reshape(-1, FRAME))
    stats = served.server.switchboard.scheduler.stats
    print(f"the engine's step p50/p99 {stats.step_ms(0.5):.0f}/{stats.step_ms(0.99):.0f} ms; "
          f"this caller's frames late {late}, dropped {dropped} (row: {call.row.late} late, "
          f"{call.row.dropped_in} dropped, {call.dropped_out} undelivered)")
    # Nothing lost on the way in but what the real-time queue's policy dropped, counted.
    assert (late, dropped, call.dropped_out) == (call.row.late, call.row.dropped_in, 0)

    heard_wav = tmp_path / "heard.wav"
    sf.write(heard_wav, heard_in.reshape(-1), 24000, subtype="FLOAT")
    env = {"PERSONAPLEX_MODEL": model_dir, "PERSONAPLEX_DEVICE": "cpu"}
    proc = run_cli("reply", heard_wav, tmp_path / "answer.wav", "--voice", "NATF2",
                   "--prompt", ROLE, "--seed", "7", "--text-out", tmp_path / "answer.json",
                   "--sample-format", "f32", env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    pieces = json.loads((tmp_path / "answer.json").read_text())
    answer, _ = sf.read(tmp_path / "answer.wav", dtype="float32")
    answer = answer[:len(said) * FRAME].reshape(-1, FRAME)

    rebuilt = said.copy()  # the gaps: what the model produced there
    spoken = []
    responses = first.responses()
    assert responses
    for response in responses:
        start, audio = response["start"], response["audio"]
        frames = np.frombuffer(b"".join(audio), "<i2").reshape(len(audio), FRAME)
        assert np.array_equal(frames, pcm16(said[start:start + len(audio)]).reshape(frames.shape))
        rebuilt[start:start + len(audio)] = frames.astype(np.float32) / 32768
        spoken += [p for p in pieces[start:start + len(audio)] if p not in SILENT]
        assert response["text"] == [p for p in pieces[start:start + len(audio)]
                                    if p not in SILENT]
    # Nothing spoken fell between responses.
    last = responses[-1]["start"] + len(responses[-1]["audio"])
    assert spoken == [p for p in pieces[:last] if p not in SILENT]
    error = np.abs(rebuilt[:len(answer)] - answer).max()
    print(f"{len(responses)} response(s) over {last} frames; largest difference from reply: "
          f"{error * 32768:.2f} PCM16 steps")
    assert error <= 1e-4 + 1 / 32768


def errors_by_event(heard: Heard) -> dict:
    return {e["error"]["event_id"]: e["error"] for e in heard.of("error")}


def test_what_it_cannot_do_is_refused_with_an_error_event(served):
    """Each refusal is an `error` event of the spec's shape naming the client event, and
    the call goes on: text items, tools, response.create with instructions, input
    transcription, a persona change once primed, unknown events and formats, a message that
    is not JSON or not text. commit, clear and truncate are answered and change nothing."""
    asks = [
        ("text", {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "hello"}]}}, "unsupported"),
        ("function", {"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": "c", "output": "{}"}}, "unsupported"),
        ("tools", {"type": "session.update", "session": {"type": "realtime", "tools": [
            {"type": "function", "name": "f", "parameters": {}}]}}, "unsupported"),
        ("instructions", {"type": "response.create",
                          "response": {"instructions": "Say hi."}}, "unsupported"),
        ("asr", {"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"transcription": {"model": "whisper-1"}}}}}, "unsupported"),
        ("persona", {"type": "session.update", "session": {
            "type": "realtime", "instructions": "You are someone else."}}, "persona_fixed"),
        ("sampling", {"type": "session.update", "session": {
            "type": "realtime", "personaplex": {"audio_topk": 5}}}, "persona_fixed"),
        ("format", {"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}, "invalid_value"),
        ("unknown", {"type": "response.dance"}, "unknown_event"),
        ("temperature", {"type": "session.update", "session": {
            "type": "realtime", "temperature": -1}}, "invalid_value"),
    ]
    answered = [{"type": "input_audio_buffer.commit", "event_id": "commit"},
                {"type": "input_audio_buffer.clear", "event_id": "clear"},
                {"type": "conversation.item.truncate", "event_id": "truncate",
                 "item_id": "item_x", "content_index": 0, "audio_end_ms": 300},
                {"type": "response.create", "event_id": "plain"},
                {"type": "session.update", "event_id": "same", "session": {
                    "type": "realtime", "instructions": ROLE,
                    "audio": {"output": {"voice": "NATF2"}}}}]

    async def misbehave(connection, heard):
        await connection.send_raw("not json {")
        await connection.send_raw(b"\x00binary")

    heard = asyncio.run(hold_call(
        served, speech_like(2.0), session={"type": "realtime", "instructions": ROLE,
                                           "audio": {"output": {"voice": "NATF2"}}},
        events=[{**event, "event_id": name} for name, event, _ in asks] + answered,
        during=misbehave))
    errors = errors_by_event(heard)
    for name, _, code in asks:
        assert errors[name]["code"] == code, (name, errors.get(name))
        assert errors[name]["type"] == "invalid_request_error" and errors[name]["message"]
    unnamed = [e["error"]["code"] for e in heard.of("error") if e["error"]["event_id"] is None]
    assert sorted(unnamed) == ["invalid_event", "invalid_json"]
    for name in ("commit", "clear", "truncate", "plain", "same"):
        assert name not in errors, errors[name]
    assert heard.of("input_audio_buffer.committed") and heard.of("input_audio_buffer.cleared")
    assert heard.of("conversation.item.truncated")[0]["audio_end_ms"] == 300
    # primed; then the tools and transcription updates, whose other parts (none) applied;
    # then the update that changed nothing. Refused whole: no session.updated.
    assert len(heard.of("session.updated")) == 4
    assert heard.of("session.updated")[-1]["session"]["instructions"] == ROLE
    assert heard.of("response.output_audio.delta"), "the call went on"


def test_connect_auth_model_and_limits(served, monkeypatch):
    """Bearer is --token; ?model= is checked; a full server, and a client over its quota,
    get an error event and close 1013; a foreign Origin or Host is refused before the
    upgrade, as on /api/chat."""
    from websockets.exceptions import InvalidStatus

    switchboard = served.server.switchboard

    async def refused(model=MODEL_ID, headers=None):
        return await hold_call(served, None, model=model, headers=headers, linger_s=0.5,
                               wait_updated=False)

    heard = asyncio.run(refused(model="gpt-realtime"))
    assert heard.of("error")[0]["error"]["code"] == "policy_violation"
    assert "personaplex-7b-v1" in heard.of("error")[0]["error"]["message"]
    assert heard.close_code == 1008 and not heard.of("session.created")

    monkeypatch.setattr(switchboard.access, "token", "s3cret")
    with pytest.raises(InvalidStatus) as status:
        asyncio.run(refused())
    assert status.value.response.status_code == 401
    sdk = AsyncOpenAI(base_url=served.url + "/v1", api_key="s3cret")

    async def with_token():
        async with sdk.realtime.connect(model="personaplex") as connection:
            return json.loads(await connection.recv_bytes())["type"]

    assert asyncio.run(with_token()) == "session.created"
    monkeypatch.setattr(switchboard.access, "token", None)

    for header, status_code in (({"Origin": "https://elsewhere.example"}, 403),
                                ({"Host": "elsewhere.example"}, 421)):
        with pytest.raises(InvalidStatus) as status:
            asyncio.run(refused(headers=header))
        assert status.value.response.status_code == status_code

    async def until(condition, what, timeout_s=20.0):
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"{what}: seats {switchboard.seats}"
            await asyncio.sleep(0.02)

    async def one_held_then(setting, value, held):
        monkeypatch.setattr(*setting, value)
        holding = asyncio.create_task(hold_call(served, speech_like(3.0)))
        await until(lambda: switchboard.seats >= held, "the held call never took its seat")
        second = await refused()
        await holding
        # The server gives the held call's seat back after the client has gone: undoing the
        # setting before that made the count one short, and the next wait never ended.
        await until(lambda: switchboard.seats < held, "the held call kept its seat")
        return second

    full = switchboard.capacity  # one seat left: the held call takes it
    for setting, value, held, words in (
            ((switchboard.scheduler, "seats"), full - 1, full, "slots are taken"),
            ((switchboard.access, "max_per_client"), 1, 1, "too many connections")):
        second = asyncio.run(one_held_then(setting, value, held))
        monkeypatch.undo()
        error = second.of("error")[0]["error"]
        assert words in error["message"] and error["code"] == "server_busy"
        assert second.close_code == 1013


def test_a_client_gone_mid_response_frees_its_seat(served):
    switchboard = served.server.switchboard

    async def vanish():
        async with client(served).realtime.connect(model=MODEL_ID) as connection:
            pcm = pcm16(speech_like(2.0))
            for k in range(len(pcm) // FRAME):
                await connection.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[k * FRAME:(k + 1) * FRAME].tobytes()).decode())
                await asyncio.sleep(0.08)
                if k > 5 and "response.output_audio.delta" in (
                        json.loads(await connection.recv_bytes())["type"],):
                    break
            connection._connection.transport.abort()  # no close frame: the socket is cut
        began = time.monotonic()
        while switchboard.seats and time.monotonic() - began < 10:
            await asyncio.sleep(0.05)
        return switchboard.seats

    assert asyncio.run(vanish()) == 0
    heard = asyncio.run(hold_call(served, speech_like(1.5)))
    assert heard.of("response.output_audio.delta") and not heard.of("error")
    assert "connection lost" in " ".join(served.lines) or "client closed" in " ".join(
        served.lines)


def test_barge_in_events_on_known_speech_times(served):
    """speech_started/stopped at the recording's speech times (±100 ms) on the caller's
    timeline, each stop followed by its commit; turn_detection null: none."""
    pcm, expected = known_turns()
    heard = asyncio.run(hold_call(served, pcm, session={"type": "realtime"}))
    turns = [("started", e["audio_start_ms"]) if e["type"].endswith("started") else
             ("stopped", e["audio_end_ms"]) for e in heard.of(
                 "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped")]
    assert [kind for kind, _ in turns] == [kind for kind, _ in expected], turns
    for (_, got), (_, want) in zip(turns, expected):
        assert abs(got - want) <= 100, turns
    started = heard.of("input_audio_buffer.speech_started")
    stopped = heard.of("input_audio_buffer.speech_stopped")
    assert [e["item_id"] for e in started] == [e["item_id"] for e in stopped]
    assert [e["item_id"] for e in heard.of("input_audio_buffer.committed")] == \
        [e["item_id"] for e in stopped]
    quiet = asyncio.run(hold_call(served, pcm[:3 * 24000], session={
        "type": "realtime", "audio": {"input": {"turn_detection": None}}}))
    assert quiet.of("session.updated")[0]["session"]["audio"]["input"]["turn_detection"] is None
    assert not quiet.of("input_audio_buffer.speech_started")


def test_cancel_keeps_the_rest_of_the_response_off_the_wire(served):
    cancelled = {}

    async def cancel(connection, heard):
        while not heard.of("response.output_audio.delta"):
            await asyncio.sleep(0.02)
        cancelled["at"] = len(heard.events)
        await connection.send({"type": "response.cancel"})

    heard = asyncio.run(hold_call(served, speech_like(3.0), during=cancel))
    done = heard.of("response.done")[0]["response"]
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled",
                                                                  "client_cancelled")
    after = heard.events[heard.events.index(heard.of("response.done")[0]) + 1:]
    assert not [e for e in after if e.get("response_id") == done["id"]]


def test_mulaw_8k_both_ways(served):
    """audio/pcmu in and out: the engine steps the caller's μ-law audio as soxr brings it
    to 24 kHz, nothing lost but what the queue counts, and each delta is the model's frame
    brought to 8 kHz by soxr and μ-law coded, exactly."""
    from personaplex_cli.audio.resample import Reframer, StreamResampler

    fresh_steps(served)
    pcm8k = speech_like(4.0, 8000, seed=9)
    mulaw = {"type": "audio/pcmu"}
    call = {}

    async def find(connection, heard):
        while not heard.of("session.created") or not live_call(
                served, heard.of("session.created")[0]["session"]["id"]):
            await asyncio.sleep(0.02)
        call["it"] = live_call(served, heard.of("session.created")[0]["session"]["id"])

    heard = asyncio.run(hold_call(
        served, pcm8k, session={"type": "realtime", "audio": {
            "input": {"format": mulaw}, "output": {"format": mulaw}}},
        wire=lambda p: telephony.ulaw_encode(pcm16(p)), frame_bytes=640, during=find))
    assert heard.of("session.updated")[0]["session"]["audio"]["output"]["format"] == mulaw
    assert heard.of("input_audio_buffer.speech_started"), "the caller was heard"
    left(call["it"])
    slot = call["it"].row.slot
    stepped = np.stack([step_in[slot] for live, step_in, _ in served.steps if slot in live])
    said = np.stack([out[slot] for live, _, out in served.steps if slot in live])
    upsampler, framer = StreamResampler(8000, 24000), Reframer(FRAME)
    wire = telephony.ulaw_encode(pcm16(pcm8k))
    for k in range(len(wire) // 640):
        framer.push(upsampler.process(telephony.from_pcm16(
            telephony.ulaw_decode(wire[k * 640:(k + 1) * 640]))))
    late, dropped = stepped_as_sent(stepped, np.stack(framer.pop_frames()))
    assert (late, dropped) == (call["it"].row.late, call["it"].row.dropped_in)
    response = heard.responses()[0]
    downsampler = StreamResampler(24000, 8000)
    for index, delta in enumerate(response["audio"]):
        expected = telephony.ulaw_encode(pcm16(downsampler.process(
            said[response["start"] + index])))
        assert delta == expected.tobytes()
    print(f"μ-law: {len(response['audio'])} deltas, {sum(map(len, response['audio']))} "
          f"bytes at 8 kHz; late {late}, dropped {dropped}")


def test_beta_clients_get_the_beta_names(served):
    heard = asyncio.run(hold_call(
        served, speech_like(1.5), headers={"OpenAI-Beta": "realtime=v1"},
        session={"voice": "NATF2", "input_audio_format": "pcm16",
                 "output_audio_format": "g711_alaw", "instructions": ROLE,
                 "modalities": ["text", "audio"]}))
    kinds = {e["type"] for e in heard.events}
    assert {"response.audio.delta", "response.audio_transcript.delta"} <= kinds
    assert not {"response.output_audio.delta", "response.output_audio_transcript.delta",
                "conversation.item.added", "conversation.item.done"} & kinds
    assert heard.of("conversation.item.created")[0]["item"]["content"][0]["type"] == "audio"
    session = heard.of("session.updated")[0]["session"]
    assert (session["voice"], session["input_audio_format"], session["output_audio_format"]) \
        == ("NATF2", "pcm16", "g711_alaw")
    deltas = heard.of("response.audio.delta")  # A-law at 8 kHz: 640 bytes a frame, about
    assert 640 * (len(deltas) - 2) <= sum(len(base64.b64decode(e["delta"])) for e in deltas) \
        <= 640 * len(deltas)


def test_priming_without_a_word_and_an_unknown_voice(served):
    """A client that says nothing is primed with the server's persona half a second after
    connecting; a voice not found here is an error event, and the default voice speaks."""
    async def silent():
        began = time.monotonic()
        heard = await hold_call(served, None, linger_s=0.0)
        return heard, time.monotonic() - began

    heard, seconds = asyncio.run(silent())
    session = heard.of("session.updated")[0]["session"]
    assert (session["instructions"], session["audio"]["output"]["voice"]) == (ROLE, "NATF2")
    assert seconds >= realtime.OPENING_S
    heard = asyncio.run(hold_call(served, speech_like(1.0), session={
        "type": "realtime", "audio": {"output": {"voice": "alloy"}}}))
    error = heard.of("error")[0]["error"]
    assert error["code"] == "voice_not_found" and "alloy" in error["message"]
    assert heard.of("session.updated")[0]["session"]["audio"]["output"]["voice"] == "NATF2"
    assert heard.of("response.output_audio.delta")


def test_a_framework_opening_applies_all_it_asks_before_priming(served):
    """As LiveKit Agents opens: an update with its settings (and input transcription, which
    is named in an error event while the rest applies), then the instructions in another;
    the persona primed is the one with those instructions."""
    opening = [{"type": "session.update", "event_id": "settings", "session": {
                   "type": "realtime", "audio": {
                       "input": {"transcription": {"model": "gpt-4o-mini-transcribe"},
                                 "turn_detection": {"type": "semantic_vad"}},
                       "output": {"format": {"type": "audio/pcma"}, "voice": "NATF2"}}}},
               {"type": "session.update", "event_id": "instructions", "session": {
                   "type": "realtime", "instructions": "You are a pirate."}}]
    heard = asyncio.run(hold_call(served, speech_like(1.0), opening=opening))
    errors = errors_by_event(heard)
    assert list(errors) == ["settings"] and errors["settings"]["code"] == "unsupported"
    assert errors["settings"]["param"] == "session.audio.input.transcription"
    updated = heard.of("session.updated")
    assert len(updated) == 1
    assert updated[0]["session"]["instructions"] == "You are a pirate."
    assert updated[0]["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    assert "You are a pirate." in " ".join(line for line in served.lines
                                           if "started" in line)


def test_a_client_that_sends_and_never_reads_is_closed(monkeypatch):
    """Each bad event earns an error event; a client that floods them and reads nothing
    is closed once MOST_WAITING_EVENTS wait, long before the idle timeout."""
    from personaplex_cli.serve import call as calls
    from personaplex_cli.serve.call import Callables
    from personaplex_cli.serve.query import Defaults, parse_call
    from personaplex_cli.runtime.rows import LiveRow

    monkeypatch.setattr(calls, "SEND_TIMEOUT_S", 0.1)
    received = 0

    async def scenario():
        never = asyncio.Event()

        async def receive():
            nonlocal received
            received += 1
            await asyncio.sleep(0)
            return '{"type": "nonsense"}'

        async def send(data):
            await never.wait()  # the client's socket is full

        async def close(code):
            await never.wait()

        defaults = Defaults(voice="NATF2", role=ROLE)
        session = realtime.RealtimeSession({}, parse_call({}, defaults, 0), defaults,
                                           beta=False)
        call = realtime.RealtimeCall(Callables(receive, send, close), LiveRow(None, None, None),
                                     session, pending=None, voice=None, number=1,
                                     client="test", idle_timeout=60.0,
                                     add_row=lambda row: None, remove_row=lambda row: None)
        return await asyncio.wait_for(call.run(), 10)

    ending = asyncio.run(scenario())
    assert ending.reason == "not reading" and "events wait" in ending.message
    assert received <= realtime.MOST_WAITING_EVENTS + 2


# -- what a stranger sends (issue 30) ----------------------------------------------------------

def odd_values():
    return [5, -1, 1.5, 10 ** 400, True, None, "x", "", [], [1, [2]], {}, {"type": []},
            {"a": {"b": None}}, "\udce9"]


def test_a_session_turns_any_event_into_an_answer():
    """Whatever shape each field of a client event has, `handle` answers with events (an
    error at most), never an exception, which ended the caller's own call before (1006,
    no error event): `output_modalities: 5` raised TypeError; 60 kB of nested `[`,
    RecursionError. A client's event_id is echoed only up to MOST_ECHOED_CHARS."""
    from personaplex_cli.serve.query import Defaults, parse_call

    defaults = Defaults(voice="NATF2", role=ROLE)
    session = realtime.RealtimeSession({}, parse_call({}, defaults, 0), defaults, beta=False)
    shapes = [
        ("session.update", "session", {"type": "realtime", "output_modalities": None}),
        ("session.update", "session", {"modalities": None}),
        ("session.update", "session", {"audio": {"input": {"format": None}}}),
        ("session.update", "session", {"audio": {"input": {"format": {"type": None}}}}),
        ("session.update", "session", {"audio": {"input": {"turn_detection": None}}}),
        ("session.update", "session", {"audio": {"output": {"voice": None}}}),
        ("session.update", "session", {"instructions": None, "temperature": None}),
        ("session.update", "session", {"personaplex": None}),
        ("session.update", "session", {"personaplex": {"seed": None}}),
        ("session.update", "session", {"tools": None}),
        ("session.update", "session", None),
        ("input_audio_buffer.append", "audio", None),
        ("response.create", "response", None),
        ("response.create", "response", {"instructions": None}),
        ("conversation.item.truncate", "item_id", None),
        ("conversation.item.truncate", "audio_end_ms", None),
        ("conversation.item.truncate", "content_index", None),
    ]
    handled = 0
    for kind, key, template in shapes:
        for value in odd_values():
            event = {"type": kind, key: template}

            def fill(node):  # every None in the template becomes `value`
                if isinstance(node, dict):
                    return {k: value if v is None else fill(v) for k, v in node.items()}
                return node

            event[key] = value if template is None else fill(template)
            session.outbox.clear()
            assert isinstance(session.handle(json.dumps(event)), list), event
            kinds = [json.loads(e)["type"] for e in session.outbox]
            assert set(kinds) <= {"error", "session.updated", "conversation.item.truncated"}, \
                kinds
            handled += 1
    for message in ("[" * 60_000, json.dumps({"type": "x", "event_id": "e" * 200}),
                    json.dumps({"type": "x", "event_id": "e" * 128})):
        session.outbox.clear()
        session.handle(message)
        error = json.loads(session.outbox[0])["error"]
        assert error["code"] in ("invalid_json", "unknown_event"), error
    assert error["event_id"] == "e" * 128
    session.outbox.clear()
    session.handle(json.dumps({"type": "x", "event_id": "e" * 200}))
    assert json.loads(session.outbox[0])["error"]["event_id"] is None
    with pytest.raises(realtime.protocol.BadMessage) as over:
        session.handle(json.dumps({"type": "x", "event_id": "e" * 70_000}))
    assert over.value.close_code == 1009
    print(f"{handled} odd events answered")


def test_appends_beyond_real_time_are_dropped_undecoded(monkeypatch):
    """Appends are held to real time plus a second, counted by their length before a byte
    is decoded, as /api/chat's pages are."""
    from personaplex_cli.serve.query import Defaults, parse_call

    defaults = Defaults(voice="NATF2", role=ROLE)
    session = realtime.RealtimeSession({}, parse_call({}, defaults, 0), defaults, beta=False)
    decoded = []
    monkeypatch.setattr(session.decoder, "decode",
                        lambda data: decoded.append(len(data)) or np.zeros(0, np.float32))
    second = base64.b64encode(bytes(2 * 24000)).decode()  # a second of PCM16
    for _ in range(10):
        session.handle(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
    assert len(decoded) == 1 and session.allowance.dropped == 9


async def burst(connection, events: list[dict]) -> None:
    """The events in one network write: their frames built first, then written at once."""
    ws = connection._connection
    for event in events:
        ws.protocol.send_text(json.dumps(event).encode())
    ws.transport.write(b"".join(ws.protocol.data_to_send()))


def test_odd_input_and_a_burst_leave_the_call_going(served):
    """A call that gets, before priming, instructions that are not UTF-8 (a lone
    surrogate: the connection dropped with nothing said), then 60 kB of nested `[`,
    `output_modalities: 5`, an echo of 1000 characters asked for, and 600 commits in one
    network write (closed as "not reading" 3 times of 3): each is answered (600
    `committed`, an error for each of the others) and the call goes on."""
    commits = [{"type": "input_audio_buffer.commit"}] * 600

    async def misbehave(connection, heard):
        await connection.send_raw("[" * 60_000)
        await connection.send({"type": "session.update", "event_id": "modalities",
                               "session": {"type": "realtime", "output_modalities": 5}})
        await connection.send({"type": "conversation.item.truncate", "event_id": "echo",
                               "item_id": "i" * 1000, "content_index": 0,
                               "audio_end_ms": 0})
        await connection.send({"type": "nonsense", "event_id": "e" * 1000})
        await burst(connection, commits)

    heard = asyncio.run(hold_call(
        served, speech_like(4.0), during=misbehave, opening=[
            {"type": "session.update", "event_id": "latin1", "session": {
                "type": "realtime", "instructions": "caf\udce9"}}]))
    errors = errors_by_event(heard)
    assert errors["latin1"]["code"] == "invalid_value", errors
    assert "not UTF-8" in errors["latin1"]["message"]
    assert errors["modalities"]["param"] == "session.output_modalities"
    assert errors["echo"]["code"] == "invalid_value"
    unnamed = sorted(e["error"]["code"] for e in heard.of("error")
                     if e["error"]["event_id"] is None)
    assert unnamed == ["invalid_json", "unknown_event"], unnamed
    assert len(heard.of("input_audio_buffer.committed")) >= 600
    assert heard.close_code is None, "the server closed the call"
    last_commit = heard.events.index(heard.of("input_audio_buffer.committed")[-1])
    assert any(e["type"] == "response.output_audio.delta"
               for e in heard.events[last_commit:]), "the call went on"


def test_one_message_limit_and_no_compression(served):
    """A message over 64 KiB is refused as on /api/chat: an error event
    (`message_too_large`), then close 1009; permessage-deflate is not accepted, so a message
    costs the server what it cost on the wire."""
    import websockets

    async def scenario():
        url = "ws" + served.url[4:] + f"/v1/realtime?model={MODEL_ID}"
        async with websockets.connect(url, compression="deflate") as ws:
            extensions = ws.protocol.extensions
            await ws.recv()  # session.created
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": "A" * 70_000}))
            events = []
            try:
                async for message in ws:
                    events.append(json.loads(message))
            except websockets.ConnectionClosed:
                pass
            return extensions, events, ws.close_code

    extensions, events, code = asyncio.run(scenario())
    assert extensions == []
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == \
        ["message_too_large"], events
    assert code == 1009


def test_an_idle_call_is_told_so(served):
    """A call that sends nothing for --idle-timeout (4 s here) gets an error event saying
    so (code `idle_timeout`, the client's doing), not `refused`, then close 1000."""
    import websockets

    async def scenario():
        url = "ws" + served.url[4:] + f"/v1/realtime?model={MODEL_ID}"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "session.update",
                                      "session": {"type": "realtime", "instructions": ROLE}}))
            errors = []
            try:
                async for message in ws:
                    event = json.loads(message)
                    if event["type"] == "error":
                        errors.append(event["error"])
            except websockets.ConnectionClosed:
                pass
            return errors, ws.close_code

    errors, code = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [(e["code"], e["type"]) for e in errors] == [("idle_timeout",
                                                         "invalid_request_error")], errors
    assert "no audio" in errors[0]["message"] and code == 1000
