"""RateAdapter: device-rate audio <-> 1920-sample 24 kHz model frames."""

from __future__ import annotations

import numpy as np
import pytest
from live_signals import chirp, find

from personaplex_cli.live.rates import RateAdapter


def test_24k_is_a_pass_through_that_still_reframes():
    ad = RateAdapter(24000)
    assert ad.passthrough
    x = np.arange(5000, dtype=np.float32)
    frames = ad.to_model(x[:3000]) + ad.to_model(x[3000:])
    assert [len(f) for f in frames] == [1920, 1920]
    np.testing.assert_array_equal(np.concatenate(frames), x[:3840])
    y = np.ones(1920, np.float32)
    assert ad.to_device(y) is y or np.array_equal(ad.to_device(y), y)


@pytest.mark.parametrize("rate", [48000, 44100, 16000])
def test_other_rates_round_trip(rate):
    ad = RateAdapter(rate)
    assert not ad.passthrough
    sig = chirp(1.0, 200, 3500)  # within every rate's passband
    device = np.concatenate([ad.to_device(sig[i:i + 1920]) for i in range(0, len(sig), 1920)]
                            + [ad.to_device(np.zeros(1920 * 4, np.float32))])
    expected = (len(sig) + 4 * 1920) * rate / 24000
    assert abs(len(device) - expected) < rate * 0.05  # soxr holds back its filter delay
    block = int(rate * 0.01)
    frames = []
    for i in range(0, len(device) - block, block):
        frames += ad.to_model(device[i:i + block])
    assert all(len(f) == 1920 for f in frames)
    back = np.concatenate(frames)
    off, ncc = find(back, sig)
    assert ncc > 0.999, (off, ncc)
