"""Streaming states are made with known options only: a misspelt one is an error, not a
silently ignored keyword (every module takes only the options it uses)."""

from __future__ import annotations

import pytest

from personaplex_cli.core.config import MimiArch
from personaplex_cli.core.mimi import Mimi
from personaplex_cli.core.streaming import StreamState

TINY = {"seanet": {"dimension": 32, "n_filters": 4},
        "transformer": {"d_model": 32, "num_heads": 4, "num_layers": 1, "dim_feedforward": 64,
                        "context": 8, "input_dimension": 32, "output_dimensions": [32]},
        "quantizer": {"dimension": 16, "input_dimension": 32, "output_dimension": 32}}


def test_unknown_state_options_are_refused():
    arch = MimiArch()
    for group, values in TINY.items():
        getattr(arch, group).update(values)
    mimi = Mimi(arch)
    assert mimi.encoder_state(1, max_frames=2, window="nvidia")  # the known ones work
    with pytest.raises(TypeError, match="windw"):
        StreamState.create(mimi.encoder_transformer, 1, dtype=mimi.dtype, windw="nvidia")
    with pytest.raises(ValueError, match="unknown attention window"):
        mimi.decoder_state(1, window="nvida")


def test_a_kv_write_in_bf16_costs_a_write_not_a_copy_of_the_ring():
    """The KV ring's write moves the new slots only: torch's CPU scatter_ in bf16 copied the
    whole ring to fp32 and back on every write (the 7B's batch-1 step spent most of its
    CPU time there), some 2000 times an fp32 write's cost; an indexed write costs alike in
    both dtypes. The rows' own slots land where a scatter would put them."""
    import time

    import torch

    from personaplex_cli.core.layers import KVRing

    slots = torch.tensor([[5, 6], [100, 101], [3000, 0], [7, 8]])
    cost = {}
    for dtype in (torch.float32, torch.bfloat16):
        ring = KVRing(torch.zeros(4, 16, 3001, 128, dtype=dtype),
                      torch.zeros(4, 16, 3001, 128, dtype=dtype))
        k = torch.randn(4, 16, 2, 128).to(dtype)
        ring.write(slots, k, -k)
        expected = torch.zeros_like(ring.keys).scatter_(
            2, slots[:, None, :, None].expand_as(k), k)
        assert torch.equal(ring.keys, expected) and torch.equal(ring.values, -expected)
        start = time.thread_time()
        for _ in range(5):
            ring.write(slots, k, k)
        cost[dtype] = time.thread_time() - start
    assert cost[torch.bfloat16] < 20 * cost[torch.float32] + 0.01, cost
