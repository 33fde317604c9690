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
from test_serve import ROLE, Served, model_dir, served  # noqa: F401 - the shared server

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
                    events: list[dict] | None = None, wire=pcm16, frame_bytes=None,
                    during=None) -> Heard:
    """One caller through the SDK: session.update (if given), then `pcm` appended in 80 ms
    frames at real-time pace (`lead_frames` ahead), then `events` sent; reads everything
    until `linger_s` after the last audio. `during(connection, heard)` runs beside."""
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
    frames = [(quiet, "PAD")] * 3 + [(quiet, "▁Hi"), (loud, "PAD")] + \
        [(quiet, "PAD")] * realtime.END_QUIET_FRAMES + [(quiet, "EPAD")] * 2
    for index, (pcm, piece) in enumerate(frames):
        responses.frame(index, pcm, piece, lambda p: "x")
    kinds = [kind for kind, _ in events]
    assert kinds.count("response.output_audio.delta") == 2 + realtime.END_QUIET_FRAMES
    assert [f["delta"] for k, f in events if k.endswith("transcript.delta")] == [" Hi"]
    done = [f for k, f in events if k == "response.done"]
    assert done[0]["response"]["status"] == "completed"
    assert done[0]["response"]["metadata"] == {"start_frame": "3"}
    assert kinds[-1] == "response.done" and kinds[0] == "response.created"
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
    responses.frame(40, loud, "▁a", str)
    assert responses.cancel() and not responses.cancel()
    for index in range(5):
        responses.frame(41 + index, loud, "▁b", str)
    assert [k for k, _ in events].count("response.output_audio.delta") == 1
    for index in range(realtime.END_QUIET_FRAMES):
        responses.frame(46 + index, quiet, "PAD", str)
    responses.frame(60, loud, "▁c", str)
    assert [k for k, _ in events].count("response.created") == 2


# -- against the server ------------------------------------------------------------------------

def test_the_sdk_holds_two_calls_and_the_audio_is_replys(served, run_cli, model_dir, tmp_path):
    """Two callers at once through the SDK, unchanged: session.update with instructions and
    a voice, 10 s of speech appended in real time, audio deltas and transcript back. For the
    first, EXACTNESS: the engine stepped exactly the PCM16 it appended (after the ticks
    before its first frame), and its audio deltas, with the gaps between responses filled
    by the frames the model produced there, are `reply` on that input with the same persona
    and seed, to PCM16's rounding; its transcript deltas are reply's pieces."""
    served.steps.clear()
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
    slot = call.row.slot
    heard_in = np.stack([step_in[slot] for live, step_in, _ in served.steps if slot in live])
    said = np.stack([out[slot] for live, _, out in served.steps if slot in live])
    sent = (pcm16(pcm[0]).astype(np.float32) / 32768)[:len(pcm[0]) // FRAME * FRAME]
    late, dropped = stepped_as_sent(heard_in, sent.reshape(-1, FRAME))
    stats = served.server.switchboard.engine.stats
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
        spoken += [p.replace("▁", " ") for p in pieces[start:start + len(audio)]
                   if p not in SILENT]
        assert response["text"] == [p.replace("▁", " ") for p in
                                    pieces[start:start + len(audio)] if p not in SILENT]
    # Nothing spoken fell between responses.
    last = responses[-1]["start"] + len(responses[-1]["audio"])
    assert spoken == [p.replace("▁", " ") for p in pieces[:last] if p not in SILENT]
    error = np.abs(rebuilt[:len(answer)] - answer).max()
    print(f"{len(responses)} response(s) over {last} frames; largest difference from reply: "
          f"{error * 32768:.2f} PCM16 steps")
    assert error <= 1e-4 + 1 / 32768
