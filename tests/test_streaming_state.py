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
