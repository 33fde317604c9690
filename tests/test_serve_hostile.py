"""`personaplex serve` at its default options on the tiny model, attacked through its newer
routes while two good callers talk (one on /api/chat, one on /v1/realtime, from another
loopback address): each attack is held to what it costs those callers, by their own
figure (seconds of the assistant's audio a second, 0.9 at least), /api/health answering
within a second, and the server's memory.

The attacks are issue 30's: Realtime appends of 750 kB of base64 zeros sent as fast as a
`websockets` client can with its default compression (3.4 MB on the wire inflated to 3.2 GB
of JSON before the fix), unknown events with a 1 MB event_id, four such connections at once,
one that never reads; then the same appends plain and just under the message limit (what an
attacker does once compression is refused and the limit holds), and streamed chat
completions whose client never reads. Each runs for ATTACK_S in a process of its own
(tests/hostile_clients.py) and its window ends a second after it stops, for the harm that
outlasts it. bench/serve_attacks.py runs the same attacks longer, side by side with the code
before a change.
"""

from __future__ import annotations

import asyncio
import functools

import pytest

import hostile_clients as hostile
from conftest import golden_model_folder
from serve_clients import ServeProcess

ATTACK_S = 2.5
LEAST_AUDIO = 0.9  # seconds of the assistant's audio a second, for each good caller
MOST_HEALTH_S = 1.0
MOST_RSS_GROWTH_MB = 120


@pytest.fixture(scope="module")
def server(cli_env, tmp_path_factory):
    """`personaplex serve` at its defaults (but the model and a free port)."""
    model = golden_model_folder(tmp_path_factory.mktemp("hostile") / "model")
    served = ServeProcess(["--model", str(model), "--device", "cpu", "--port", "0"],
                          {**cli_env, "PERSONAPLEX_DEVICE": "cpu"})
    try:
        assert served.listening.wait(180), served.lines
        yield served
    finally:
        served.stop()


def test_attacks_on_the_new_routes_cost_the_good_callers_nothing(server):
    # The default --max-sessions is what the warm-up steps in real time: on a machine too
    # busy for six, the attackers would be refused a seat and prove nothing.
    seats = int(server.start_line.split(" session")[0].rsplit(" ", 1)[1])
    assert seats >= 6, f"the warm-up found {seats} seats: this machine is too busy " \
        "for the attacks to reach the server (check uptime)"
    base = server.base
    realtime = "ws" + base[4:] + "/v1/realtime"
    flood = functools.partial(hostile.realtime_flood, realtime, ATTACK_S)
    attacks = [
        ("quiet", hostile.quiet, (ATTACK_S,)),
        ("deflate", flood, ()),
        ("event_id", functools.partial(flood, event_id_bytes=1_000_000), ()),
        ("four", functools.partial(flood, connections=4), ()),
        ("no reader", functools.partial(flood, read=False), ()),
        ("plain 60k", functools.partial(flood, compress=False, append_bytes=60_000), ()),
        ("streams", hostile.unread_streams, (base, hostile.speech_flac(30.0), 4, ATTACK_S)),
    ]
    windows = asyncio.run(hostile.under_attack(base, server.proc.pid, attacks))
    print("\n" + hostile.HEADER + "\n" + "\n".join(w.row() for w in windows))
    quiet, attacked = windows[0], windows[1:]
    # Without an attack the figure must hold, or this machine cannot tell anything here.
    assert quiet.chat >= LEAST_AUDIO and quiet.realtime >= LEAST_AUDIO, (
        f"the good callers fall short with no attack at all: {quiet.row()} (check uptime)")
    for window in attacked:
        assert window.chat >= LEAST_AUDIO and window.realtime >= LEAST_AUDIO, window.row()
        assert window.health_s <= MOST_HEALTH_S, window.row()
    peak = max(window.rss_mb for window in attacked)
    assert peak - quiet.rss_mb <= MOST_RSS_GROWTH_MB, (quiet.rss_mb, peak)
    lines = server.lines
    assert not [line for line in lines if "Traceback" in line], lines[-20:]
    assert len(lines) < 60, lines[-20:]
