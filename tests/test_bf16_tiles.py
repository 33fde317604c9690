"""The bf16 product built on this machine (model/native.py's NativeBF16, rows.c): a quantized
LM's bf16 linears (text head, depformer inputs and heads) kept in its tiles
(core.quantize.TiledLinear, tile_bf16_linears); unquantized models never take it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from personaplex_cli.core.quantize import TiledLinear, tile_bf16_linears
from personaplex_cli.model import load, native
from personaplex_cli.model.load import load_lm

CPU = torch.device("cpu")


def bf16_kernel():
    kernel = native.native_bf16_for(CPU, "int8", torch.bfloat16)
    if kernel is None:
        pytest.skip(f"no bf16 kernel built here ({native.native_int8().why})")
    return kernel


@pytest.mark.parametrize("n, k", [(16, 2), (37, 200), (256, 64), (2048, 1024), (100, 4096)])
def test_products_within_bf16_rounding_and_rows_on_their_own(n, k):
    kernel = bf16_kernel()
    generator = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    rows = torch.randn(9, k, generator=generator).bfloat16()
    layer = TiledLinear(kernel, kernel.pack(weight), n, k)
    got = layer(rows)
    assert got.shape == (9, n) and got.dtype == torch.bfloat16
    exact = rows.double() @ weight.double().T
    # fp32 sums of k products, then one rounding to bf16
    assert torch.allclose(got.double(), exact, rtol=2 ** -8, atol=1e-5 * k ** 0.5)
    assert (got.double() - exact).abs().mean() <= (F.linear(rows, weight).double()
                                                   - exact).abs().mean() * 2
    for m in range(1, 9):  # every pass shape: a row's answer whoever shares its call
        assert torch.equal(layer(rows[:m]), got[:m])
        assert torch.equal(layer(rows[m:m + 1]), got[m:m + 1])
    assert torch.equal(layer.weight, weight)  # unpacked as it went in
    assert torch.equal(layer(rows.float()), got.float())  # other dtypes through bf16


def test_a_quantized_lm_tiles_its_bf16_linears_and_keeps_its_state(golden_dir, monkeypatch):
    kernel = bf16_kernel()
    lm = load_lm(golden_dir, CPU, torch.bfloat16, quantize="int8")
    tiled = {name for name, m in lm.named_modules() if isinstance(m, TiledLinear)}
    steps = len(lm.depformer_in)
    assert tiled == {"text_linear", "depformer_in_fused",
                     *(f"linears.{i}" for i in range(len(lm.linears))),
                     *(f"depformer_in.{i}" for i in range(steps))}
    # each step's projection is a slice of the fused tiles: one copy of the weights
    fused = lm.depformer_in_fused.tiles
    for step in lm.depformer_in:
        assert step.tiles.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    monkeypatch.setattr(load, "native_bf16_for", lambda *args: None)  # as without the kernel
    reference = load_lm(golden_dir, CPU, torch.bfloat16, quantize="int8")
    assert not any(isinstance(m, TiledLinear) for m in reference.modules())
    saved = reference.state_dict()
    assert tile_bf16_linears(reference, None) == []
    assert lm.state_dict().keys() == saved.keys()
    for key, tensor in lm.state_dict().items():
        assert torch.equal(tensor, saved[key]), key
    context = torch.randn(1, 1, lm.dim).bfloat16()
    plain = F.linear(context, saved["text_linear.weight"]).double()
    assert torch.allclose(lm.text_linear(context).double(), plain, rtol=2 ** -6, atol=1e-3)
    projected = lm.depformer_inputs(context)  # fused, and each step on its own: the same bits
    for step in range(steps):
        assert torch.equal(projected[:, step], lm.depformer_in[step](context))
    assert kernel is lm.text_linear.kernel_face


@pytest.mark.parametrize("quantize, dtype", [("none", torch.bfloat16), ("int8", torch.float32)])
def test_no_tiles_where_the_reference_rounding_holds_or_not_bf16(golden_dir, quantize, dtype):
    lm = load_lm(golden_dir, CPU, dtype, quantize=quantize)
    assert not any(isinstance(m, TiledLinear) for m in lm.modules())
    assert native.native_bf16_for(CPU, "none", torch.bfloat16) is None
    assert native.native_bf16_for(torch.device("cuda"), "int8", torch.bfloat16) is None


def test_compiled_tiles_answer_as_eager():
    kernel = bf16_kernel()
    weight = torch.randn(40, 64).bfloat16()
    layer = TiledLinear(kernel, kernel.pack(weight), 40, 64)
    x = torch.randn(3, 1, 64).bfloat16()
    compiled = torch.compile(layer, fullgraph=True)  # inductor, as --compile
    assert torch.equal(compiled(x), layer(x))


def test_a_bf16_product_answering_wrongly_is_not_used(monkeypatch, tmp_path):
    bf16_kernel()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "bf16_answers_right", lambda kernel: False)
    native.native_int8.cache_clear()
    try:
        kernel = native.native_int8()
        assert kernel.kernel is not None and kernel.bf16 is None  # int8's still runs
        assert native.native_bf16_for(CPU, "int8", torch.bfloat16) is None
    finally:
        native.native_int8.cache_clear()
