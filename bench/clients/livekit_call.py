"""LiveKit Agents' PersonaPlex realtime plugin (livekit-plugins-nvidia[personaplex], from
PyPI; run it with the interpreter of a venv that has it and soundfile) against a server: a
24 kHz recording pushed at real time in 20 ms chunks, then silence, for SECONDS after the
handshake -> one JSON line: the call, the assistant audio received, what is missing, the
first audio after the handshake, and how far the audio arrives behind a real-time schedule
from its first frame (p50, max).

Run: /path/to/venv-livekit/bin/python bench/clients/livekit_call.py ws://HOST:PORT WAV SECONDS
"""
import asyncio
import json
import sys
import time

import aiohttp
import numpy as np
import soundfile as sf
from livekit import rtc
from livekit.plugins.nvidia.experimental.realtime import RealtimeModel

url, wav, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])

async def main():
    pcm, rate = sf.read(wav, dtype="int16")
    assert rate == 24000
    async with aiohttp.ClientSession() as http:
        model = RealtimeModel(base_url=url, voice="NATF2", text_prompt="You are a helpful assistant.",
                              http_session=http)
        session = model.session()
        got = {"samples": 0, "first": None, "text": ""}
        async def drain(gen):
            async for msg in gen.message_stream:
                async def audio(s):
                    async for f in s:
                        now = time.perf_counter()
                        if got["first"] is None:
                            got["first"] = now
                        # how far this audio arrives behind a real-time schedule from the first
                        got.setdefault("lags", []).append(now - got["first"] - got["samples"] / 24000)
                        got["samples"] += f.samples_per_channel
                async def text(s):
                    async for t in s:
                        got["text"] += t
                await asyncio.gather(audio(msg.audio_stream), text(msg.text_stream))
        session.on("generation_created", lambda ev: asyncio.ensure_future(drain(ev)))
        await asyncio.wait_for(session._handshake_event.wait(), 120)
        hs = time.perf_counter()
        step = 480  # 20 ms chunks at real time
        t = 0
        while time.perf_counter() - hs < seconds:
            chunk = pcm[t:t + step] if t < len(pcm) else np.zeros(step, np.int16)
            if len(chunk) < step:
                chunk = np.pad(chunk, (0, step - len(chunk)))
            session.push_audio(rtc.AudioFrame(chunk.tobytes(), 24000, 1, step))
            t += step
            due = hs + t / 24000
            await asyncio.sleep(max(0, due - time.perf_counter()))
        call = time.perf_counter() - hs
        await session.aclose()
        received = got["samples"] / 24000
        print(json.dumps({"call_s": round(call, 2), "received_s": round(received, 2),
                          "missed_s": round(call - received, 2),
                          "first_audio_after_handshake_s": None if got["first"] is None else round(got["first"] - hs, 2),
                          "lag_p50_s": round(float(np.median(got.get("lags", [0]))), 3),
                          "lag_max_s": round(float(np.max(got.get("lags", [0]))), 3),
                          "text": got["text"][:60]}))

asyncio.run(main())
