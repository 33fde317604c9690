"""Weight quantization: the int8 and fp8 arithmetic, which linears it replaces, loading
quantized tensor by tensor, and the memory arithmetic against what loading allocates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from personaplex_cli.core.config import Arch
from personaplex_cli.core.layers import InputMajorLinear
from personaplex_cli.core import quantize as quantize_module
from personaplex_cli.core.quantize import (FP8_DTYPE, FP8_MAX, INT4_GROUP, INT8_MAX,
                                           QUANTIZED_PARTS, Fp8Linear, Int4Linear, Int8Linear,
                                           Int8RowsLinear, fbgemm_present, int4_kernel,
                                           int8_kernel, linear_kernels, quantized_linears,
                                           replace_linears)
from personaplex_cli.errors import DeviceError
from personaplex_cli.model.device import check_quantize, default_dtype
from personaplex_cli.model.load import load_lm
from personaplex_cli.model.memory import (GIB, MemoryNeed, check_fits, kv_bytes_per_stream,
                                          lm_weight_bytes, memory_need, sessions_that_fit,
                                          tensor_bytes)
from personaplex_cli.model.tensorfile import TensorFileError, read_header, read_tensor

ASSETS = Path(__file__).parent / "data" / "golden" / "assets"
torch.set_grad_enabled(False)


def random_linear(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False).to(dtype)
    linear.weight[3].zero_()  # an all-zero row must quantize to zeros, not NaN
    return linear


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [256, 88])  # 88: where the bf16 kernel cannot be used
def test_int8_is_symmetric_per_row_and_matches_its_dequantized_weight(dtype, width):
    linear = random_linear(width, 96, dtype)
    q = Int8Linear.from_linear(linear)
    w = linear.weight.float()
    assert q.weight_int8.dtype == torch.int8 and q.scale.dtype == dtype
    assert q.weight_int8.abs().max() <= INT8_MAX
    # Every row uses its whole range: its largest weight lands on +-127.
    nonzero = torch.arange(96) != 3
    assert (q.weight_int8[nonzero].abs().amax(dim=1) >= INT8_MAX - 1).all()
    assert torch.equal(q.weight_int8[3], torch.zeros(width, dtype=torch.int8))
    # Rounding to nearest: within half a step of the weight, per row.
    exact = q.weight_int8.float() * q.scale.float()[:, None]
    assert ((exact - w).abs() <= 0.5 * q.scale.float()[:, None] * 1.01).all()
    x = torch.randn(2, 3, width).to(dtype)
    y = q(x)
    assert y.shape == (2, 3, 96) and y.dtype == dtype and torch.isfinite(y).all()
    reference = F.linear(x.float(), q.dequantized().float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.float() - reference).abs().max() <= tolerance * reference.abs().max()
    assert cosine(y, linear(x)) > 0.9999


needs_fbgemm = pytest.mark.skipif(not fbgemm_present(), reason="torch without fbgemm")


def native_kernel():
    """The int8 kernel built on this machine (model/native.py), or None."""
    from personaplex_cli.model.native import native_int8

    return native_int8().library


def use_rows_kernel(name: str, monkeypatch) -> str:
    """Layers prepared (and models loaded) from now on take this int8 kernel for activation
    rows; a machine without it skips the test, saying why."""
    from personaplex_cli.model import native

    if not fbgemm_present():
        pytest.skip("torch without fbgemm")
    if name == "native" and native_kernel() is None:
        pytest.skip(f"no native int8 kernel here: {native.native_int8().why}")
    for value in ("_NATIVE", "_PACK_NATIVE"):  # put back as they were after the test
        monkeypatch.setattr(quantize_module, value, getattr(quantize_module, value))
    if name == "fbgemm":
        monkeypatch.setattr(native, "native_int8", lambda: native.NativeKernel(None, "test"))
    native.use_native_int8(torch.device("cpu"), "int8")  # as loading does
    return name


@pytest.fixture(params=["native", "fbgemm"])
def rows_kernel(request, monkeypatch):
    """int8 with activation rows through the kernel built here (AVX-512 VNNI and a C
    compiler), then through fbgemm's."""
    return use_rows_kernel(request.param, monkeypatch)


def per_batch_scale(rows: torch.Tensor, packed) -> torch.Tensor:
    """fbgemm's own dynamic linear: ONE activation scale for the whole batch (what a row
    must not depend on), for the tests to show they would catch it."""
    return torch.ops.quantized.linear_dynamic(rows.float().contiguous(), packed)


def one_scale_for_all(layer: Int8RowsLinear):
    """A native int8 layer's product with one activation scale for the whole batch (what a
    row must not depend on), for the tests to show they would catch it."""
    q, scale = layer.int8_weight().float(), layer.native_scale

    def run(rows):
        shared = rows.float().abs().amax().clamp(min=1e-12) / INT8_MAX
        return ((rows.float() / shared).round() @ q.t() * scale * shared).to(rows.dtype)

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_quantizes_each_activation_row_by_its_own_scale(dtype, rows_kernel):
    """int8 on the CPU: the product of each row's int8 activations (its own scale,
    max|row| / 127) with the int8 weights, exact in int32, by the kernel built here and by
    fbgemm's; a row gives the same bits alone as in a batch of 8 whose other rows are 10^6
    times larger or smaller, where one scale for the batch (fbgemm's own dynamic linear)
    changes the small rows."""
    linear = random_linear(256, 96, dtype)
    q = Int8RowsLinear.from_linear(linear)
    assert q.kernel() == rows_kernel and q.weight_int8 is None
    assert (q.packed is not None) == (rows_kernel == "fbgemm")
    assert (q.native_blocked is not None) == (rows_kernel == "native")
    fbgemm = Int8RowsLinear(256, 96, dtype=dtype)
    fbgemm.load_state_dict(Int8RowsLinear.quantize(linear.weight, dtype))
    fbgemm.fbgemm_handle = None
    packed = quantize_module.fbgemm_pack(fbgemm.weight_int8, fbgemm.scale.float())
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=generator) * torch.logspace(-3, 3, 8)[:, None]
    x = x.to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (8, 96)
    # What the arithmetic says, in float64: a = round(x / s_x), y = s_x * s_w * (a . q)
    x64 = x.double()
    s_x = (x64.abs().amax(dim=1, keepdim=True) / INT8_MAX).float().double()
    a = (x.float() / s_x.float()).round().double()
    assert a.abs().max() <= INT8_MAX and (a.abs().amax(dim=1) == INT8_MAX).all()
    exact = s_x * (a @ q.int8_weight().double().t()) * q.scale.double()
    relative = ((y.double() - exact).abs().amax(dim=1) / exact.abs().amax(dim=1))
    assert (relative < (1e-6 if dtype == torch.float32 else 1e-2)).all()
    assert cosine(y, linear(x)) > 0.999
    for row in range(8):
        assert torch.equal(q(x[row:row + 1])[0], y[row]), row
    # both kernels' bits are the same
    assert torch.equal(y, quantize_module.fbgemm_rows_linear(x, packed).to(dtype))
    batch = per_batch_scale(x, packed)
    alone = torch.cat([per_batch_scale(x[row:row + 1], packed) for row in range(8)])
    assert not torch.equal(batch[0], alone[0])  # one scale for all: the smallest row moves


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_int8_kernel_answers_fbgemm_bits_at_any_shape(dtype, monkeypatch):
    """rows.c pads its weight layout to whole tiles of 16 rows and groups of 4 columns,
    and takes 8, 4, 3, 2 or 1 activation rows at a pass with up to 8 tiles side by side:
    widths off a group, row counts off a tile, each kind of pass, and the 7B's widths give
    fbgemm's bits; the weight comes back out as it went in (what a state dict saves)."""
    use_rows_kernel("native", monkeypatch)
    generator = torch.Generator().manual_seed(5)
    for k, n in [(64, 64), (30, 37), (100, 300), (1024, 6), (2816, 130), (4096, 12)]:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        q[1] = 0
        scale = (torch.rand(n, generator=generator) / 100).to(dtype)
        layer = Int8RowsLinear(k, n, dtype=dtype)
        layer.load_state_dict({"weight_int8": q.clone(), "scale": scale})
        assert layer.prepare() and layer.kernel() == "native" and layer.weight_int8 is None
        assert torch.equal(layer.int8_weight(), q)
        assert torch.equal(layer.state_dict()["weight_int8"], q)
        packed = quantize_module.fbgemm_pack(q, scale.float())
        for m in (1, 2, 3, 4, 5, 8, 9, 15):
            x = (torch.randn(m, k, generator=generator) * 3).to(dtype)
            x[0, :3] = 0
            expected = quantize_module.fbgemm_rows_linear(x, packed).to(dtype)
            assert torch.equal(layer(x), expected), (k, n, m)
        assert torch.equal(layer(torch.zeros(2, k, dtype=dtype)), torch.zeros(2, n, dtype=dtype))
        # rows not laid out one after the other, and fp16 ones, go through fp32
        x = torch.randn(k, 3, generator=generator).to(dtype)
        assert torch.equal(layer(x.t()), layer(x.t().contiguous()))
        half = layer(x.t().half())
        assert half.dtype == torch.float16
        assert torch.equal(half, layer.native_run(x.t().half().float()).half())


@pytest.mark.parametrize("mode", ["none", "int8", "int8-weights", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_which_precision_takes_which_kernel(golden_dir, monkeypatch, mode, dtype):
    """None keeps F.linear and torch's attention kernel (the reference's rounding, bit for
    bit: tests/test_golden.py); int8 takes fbgemm with activation rows on a CPU that has it
    and the weight-only kernel elsewhere; int8-weights always the weight-only kernel, or a
    plain matmul where its width is not a multiple of 16 (bf16's kernel is wrong there)."""
    if mode == "fp8" and dtype == torch.float32:
        pytest.skip("fp8 is one case")
    lm = load_lm(golden_dir, torch.device("cpu"), dtype, quantize=mode)
    kernels = linear_kernels(lm)
    linears = [module for part in QUANTIZED_PARTS for module in getattr(lm, part).modules()
               if isinstance(module, (torch.nn.Linear, InputMajorLinear, Int8Linear,
                                      Int4Linear, Fp8Linear))]
    assert sum(kernels.values()) == len(linears) == 72  # 2 + 2 x 8 layers, 4 linears each
    widths = {"plain": sum(m.in_features % 16 != 0 for m in linears)}
    rows = "native" if native_kernel() is not None else "fbgemm" if fbgemm_present() else None
    expected = {"none": {"none": len(linears)},
                "int8": ({rows: len(linears)} if rows else None),
                "int8-weights": {"int8pack": len(linears) - widths["plain"], **widths},
                "fp8": {"fp8": len(linears)}}
    if mode == "int4":
        assert set(kernels) <= {"cpu", "plain"} and kernels.get("cpu")
    elif expected[mode] is not None:
        assert kernels == {k: v for k, v in expected[mode].items() if v}
    assert widths["plain"]  # the golden tiny has such widths: both branches are taken
    from personaplex_cli.core.layers import Attention

    reference = {m.reference_kernel for m in lm.modules() if isinstance(m, Attention)}
    assert reference == {mode == "none"}
    # Without the native kernel and fbgemm (a torch built without it, or off x86), and on
    # CUDA, int8 is int8-weights; they only ever take int8's activation rows on the CPU.
    assert int8_kernel(torch.device("cuda"), 4096, True) == "int8pack"
    assert int8_kernel(torch.device("cpu"), 4096, False) == "int8pack"
    monkeypatch.setattr(quantize_module, "_PACK_NATIVE", True)
    assert int8_kernel(torch.device("cpu"), 4096, True) == "native"
    assert int8_kernel(torch.device("cpu"), 4096, False) == "int8pack"
    monkeypatch.setattr(quantize_module, "_PACK_NATIVE", False)
    assert int8_kernel(torch.device("cpu"), 4096, True) == ("fbgemm" if fbgemm_present()
                                                            else "int8pack")
    monkeypatch.setattr(quantize_module, "fbgemm_present", lambda: False)
    assert int8_kernel(torch.device("cpu"), 4096, True) == "int8pack"
    assert int8_kernel(torch.device("cpu"), 88, True) == "plain"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_in_a_batch_of_8_answers_as_it_does_alone(golden_dir, monkeypatch, request,
                                                        dtype, rows_kernel):
    """The golden tiny LM with int8 (each kernel, activation rows), greedy, 8 streams of their
    own caller codes: each row's 16 frames in a batch of 8 are the tokens it gives alone.
    With one activation scale for the whole batch instead, some row's tokens change. The
    temporal window attends by bags, as the 7B's does. On one thread: fbgemm splits even the
    tiny model's products between threads, and a loaded machine makes each split wait for
    its turn (1.4 ms a call instead of 14 us)."""
    from personaplex_cli.core import layers
    from personaplex_cli.core.generator import FrameGenerator
    from personaplex_cli.core.sampling import Sampling
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    lm = load_lm(golden_dir, torch.device("cpu"), dtype, quantize="int8")
    assert set(linear_kernels(lm)) == {rows_kernel}
    user = torch.randint(0, lm.card, (16, 8, lm.n_q // 2),
                         generator=torch.Generator().manual_seed(3))
    user[:, 5] //= 7  # rows unlike each other: one keeps to low codes

    def frames(rows: list[int]) -> torch.Tensor:
        gen = FrameGenerator(lm, len(rows))
        assert all(isinstance(ring, layers.BlockKVRing) == (module in lm.transformer.modules())
                   for module, ring in gen.temporal.items() if isinstance(module, layers.Attention))
        for index in range(len(rows)):
            gen.set_sampling(index, Sampling(greedy=True))
        out = [gen.step(user=user[t, rows]) for t in range(len(user))]
        return torch.stack([frame for frame in out if frame is not None])

    together = frames(list(range(8)))
    for row in range(8):
        assert torch.equal(together[:, row], frames([row])[:, 0]), row
    if rows_kernel == "fbgemm":
        monkeypatch.setattr(quantize_module, "fbgemm_rows_linear", per_batch_scale)
    else:
        for layer in lm.modules():
            if isinstance(layer, Int8RowsLinear):
                monkeypatch.setattr(layer, "native_run", one_scale_for_all(layer))
    shared_scale = frames(list(range(8)))
    assert not torch.equal(shared_scale, together)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 256), (2064, 192), (96, 88), (40, 128)])
def test_int4_is_groupwise_and_its_kernel_matches_its_dequantized_weight(dtype, shape):
    """(out, in): 96 x 256 and 2064 x 192 (rows past one packing chunk) take torch's packed
    CPU kernel; 88 wide (no group size divides it) and 40 rows (not a multiple of 16) the
    plain matmul on the unpacked weight."""
    rows, width = shape
    linear = random_linear(width, rows, dtype)
    q = Int4Linear.from_linear(linear)
    kernel = int4_kernel(torch.device("cpu"), rows, width, dtype)
    assert kernel == ("cpu" if rows % 16 == 0 and width % INT4_GROUP == 0 else "plain")
    assert q.weight_int4.dtype == torch.uint8 and q.weight_int4.shape == (rows, width // 2)
    group = INT4_GROUP if width % INT4_GROUP == 0 else width
    assert q.scales_zeros.shape == (width // group, rows, 2) and q.scales_zeros.dtype == dtype
    # Asymmetric rounding to nearest: each weight within half a step of its group's grid
    # (plus the compute dtype's rounding of the grid), an all-zero row exactly zero.
    w = linear.weight.float()
    step = q.scales_zeros[..., 0].float().t().repeat_interleave(group, dim=1)
    dequantized = q.dequantized().float()
    assert ((dequantized - w).abs() <= 0.5 * step + 1e-2 * w.abs().amax()).all()
    assert dequantized[3].abs().max() == 0
    x = torch.randn(2, 3, width).to(dtype)
    y = q(x)
    assert y.shape == (2, 3, rows) and y.dtype == dtype and torch.isfinite(y).all()
    reference = F.linear(x.float(), dequantized)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.float() - reference).abs().max() <= tolerance * reference.abs().max()
    assert cosine(y, linear(x)) > 0.99


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_quantized_models_attend_with_bags_and_the_others_with_torch_kernel(mode):
    """A quantized LM's attention leaves torch's fused kernel for bag_attention on the CPU
    (faster for one query: bench/floor.py --attention); an unquantized one keeps the fused
    kernel, whose rounding is the reference's. The bags agree with the fused kernel to
    bf16's rounding of the scores, and in fp32 to fp32's, over a full ring and a part."""
    from personaplex_cli.core.layers import Attention, BlockKVRing, bag_attention
    from personaplex_cli.core.lm import LMModel
    from personaplex_cli.core.quantize import replace_linears
    from personaplex_cli.doctor.bench import bench_arch

    with torch.device("meta"):
        lm = LMModel(dict(bench_arch("tiny").lm), 8, torch.bfloat16)
    replace_linears(lm, mode, torch.bfloat16)
    kernels = {module.reference_kernel for module in lm.modules()
               if isinstance(module, Attention)}
    assert kernels == {mode == "none"}
    generator = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(shape, generator=generator)
                       for shape in ((2, 8, 1, 64), (2, 8, 300, 64), (2, 8, 300, 64)))
    q = 3 * q  # peaked weights, as trained attention has
    for used in (300, 131):  # the whole ring, and its first slots (a trimmed window)
        mask = torch.ones(2, 1, 1, used, dtype=torch.bool)
        mask[0, ..., 250:] = False  # a row whose ring is not full
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 0.05)):
            args = [t.to(dtype) for t in (q, keys, values)]
            ring = BlockKVRing.empty(2, 8, 300, 64, torch.device("cpu"), dtype)
            ring.write(torch.arange(300).expand(2, 300), args[1], args[2])
            fused = F.scaled_dot_product_attention(args[0], args[1][:, :, :used],
                                                   args[2][:, :, :used], attn_mask=mask)
            ours = bag_attention(args[0], ring, mask).float()
            assert (ours - fused.float()).abs().max() <= tolerance
            assert (ours - fused.float()).abs().mean() <= tolerance / 10


def test_a_ring_of_keys_by_blocks_holds_and_saves_what_a_plain_one_does():
    """bag_attention's ring stores its keys by blocks of slots, each dimension-major; what
    it is written, what it saves for a persona and what it restores are the plain ring's,
    element for element, and it holds what model/memory.py counts for it."""
    from personaplex_cli.core.layers import (
        BAG_ATTENTION_FROM,
        Attention,
        BlockKVRing,
        KVRing,
        key_blocks,
    )

    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    attention = Attention(64, 4, context=3000)
    plain = attention.init_state(3, cpu, dtype=torch.bfloat16)
    attention.reference_kernel = False
    blocked = attention.init_state(3, cpu, dtype=torch.bfloat16)
    assert isinstance(plain, KVRing) and isinstance(blocked, BlockKVRing)
    assert key_blocks(3001) == (24, 126)  # 3024 slots: 23 of padding, not 71
    assert blocked.key_blocks.shape == (3, 4, 24, 16, 126)
    assert blocked.values.shape == plain.values.shape == (3, 4, 3001, 16)
    # a window as short as the depformer's is faster under torch's one fused call
    for context, bags in ((16, False), (BAG_ATTENTION_FROM, True)):
        short = Attention(64, 4, context=context)
        short.reference_kernel = False
        ring = short.init_state(1, cpu, dtype=torch.bfloat16)
        assert isinstance(ring, BlockKVRing) == bags
    for slots in (torch.tensor([[0, 1], [125, 126], [2999, 3000]]),
                  torch.tensor([[2], [6], [0]])):
        k, v = (torch.randn(3, 4, slots.shape[1], 16, generator=generator).bfloat16()
                for _ in range(2))
        for ring in (plain, blocked):
            ring.write(slots, k, v)
    assert torch.equal(blocked.values, plain.values)
    assert torch.equal(blocked.keys(3001), plain.keys)
    for row in range(3):
        saved = blocked.save(row, 3001 if row == 2 else 130)
        assert all(torch.equal(a, b) for a, b in zip(saved, plain.save(row, saved[0].shape[1])))
        assert saved[0].is_contiguous() and saved[1].is_contiguous()
        fresh = attention.init_state(3, cpu, dtype=torch.bfloat16)
        fresh.restore(1, saved)
        assert torch.equal(fresh.keys(3001)[1], blocked.keys(3001)[row] * (
            torch.arange(3001)[:, None] < saved[0].shape[1]))
    arch = Arch()
    lm_arch = dict(arch.lm, num_layers=1, dim=64, num_heads=4, context=3000)
    plain_bytes, blocked_bytes = (
        kv_bytes_per_stream(lm_arch, arch.mimi.transformer, torch.bfloat16, "cpu", mode)
        for mode in ("none", "int8"))
    held = lambda ring: sum(t[:1].numel() * t.element_size() for t in vars(ring).values())
    assert blocked_bytes - plain_bytes == held(blocked) - held(plain) == 23 * 64 * 2


def test_attention_over_keys_by_blocks_answers_as_torch_kernel_does():
    """A long window's attention with its keys stored by blocks, in chunks of several steps
    (torch's kernel over the keys put back in order) and one step at a time (the bags),
    answers as the plain ring under torch's fused kernel, in fp32, as the ring wraps."""
    from personaplex_cli.core.layers import Attention, WindowState
    from personaplex_cli.core.streaming import StreamState

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    context = 300
    attention = Attention(64, 4, context=context).eval()
    rings = {}
    for fused in (True, False):
        attention.reference_kernel = fused
        ring = attention.init_state(2, cpu, dtype=torch.float32)
        rings[fused] = StreamState({attention: ring})
    window = WindowState(torch.zeros(2, dtype=torch.long),
                         torch.full((2, context + 1), -1), context, "exact", 1)
    with torch.no_grad():
        for steps in (5, 1, 3, 1, 1, *[40] * 8, 1, 1):
            _, slots, mask = window.advance(steps)
            x = torch.randn(2, steps, 64)
            outs = {}
            for fused in (True, False):
                attention.reference_kernel = fused
                outs[fused] = attention(x, None, slots, mask, rings[fused])
            torch.testing.assert_close(outs[False], outs[True], atol=1e-5, rtol=1e-5)


def test_int4_is_refused_on_a_gpu_older_than_its_kernel(monkeypatch):
    check_quantize(torch.device("cpu"), "int4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(DeviceError, match=r"compute capability 8\.0 or newer.*Tesla T4 has "
                                          r"7\.5: use --quantize int8"):
        check_quantize(torch.device("cuda"), "int4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    check_quantize(torch.device("cuda"), "int4")


def test_fp8_scales_each_row_into_e4m3_and_stays_close():
    linear = random_linear(128, 64, torch.bfloat16)
    q = Fp8Linear.from_linear(linear)
    assert q.weight_fp8.dtype == FP8_DTYPE and q.scale.dtype == torch.float32
    w = linear.weight.float()
    assert torch.isfinite(q.weight_fp8.float()).all()
    assert q.weight_fp8.float().abs().amax(dim=1)[torch.arange(64) != 3].min() >= FP8_MAX * 0.99
    # e4m3 keeps 3 mantissa bits: each weight within 1/16 of itself (or of the row's smallest
    # normal, for weights near zero).
    error = (q.dequantized().float() - w).abs()
    floor = q.scale[:, None] * 2.0 ** -6
    assert (error <= w.abs() / 16 + floor).all()
    # The product goes through torch._scaled_mm, which torch emulates on the CPU.
    x = torch.randn(5, 128).to(torch.bfloat16)
    y = q(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 64)
    assert cosine(y, linear(x)) > 0.998


def test_fp8_is_refused_without_fp8_hardware():
    with pytest.raises(DeviceError, match="compute capability 8.9"):
        check_quantize(torch.device("cpu"), "fp8")
    check_quantize(torch.device("cpu"), "int8")


def test_cpu_default_dtype_follows_native_bf16(monkeypatch):
    import personaplex_cli.model.device as device

    monkeypatch.setattr(device, "cpu_computes_bf16", lambda: True)
    assert default_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(device, "cpu_computes_bf16", lambda: False)
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16


def test_only_the_transformers_linears_are_replaced(golden_dir):
    lm = load_lm(golden_dir, torch.device("cpu"), torch.float32)
    names = quantized_linears(lm)
    assert names and all(n.startswith(("transformer.", "depformer.")) for n in names)
    replace_linears(lm, "int8", torch.float32)
    for name, module in lm.named_modules():
        if name in names:
            assert isinstance(module, Int8Linear), name
        elif isinstance(module, (torch.nn.Linear, InputMajorLinear)):  # heads, inputs stay
            assert name.startswith(("text_linear", "linears.", "depformer_in.")), name
    assert all(p.dtype == torch.float32 for p in lm.parameters())  # embeddings, norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", ["int8", "int8-weights"])
def test_loading_quantized_equals_quantizing_the_loaded_weights(golden_dir, dtype, quantize):
    """The same stored weights either way: int8's (held by fbgemm, packed, on the CPU) read
    back exactly as int8-weights' own buffer."""
    plain = load_lm(golden_dir, torch.device("cpu"), dtype)
    quantized = load_lm(golden_dir, torch.device("cpu"), dtype, quantize=quantize)
    plain_modules = dict(plain.named_modules())
    count = 0
    for name, module in quantized.named_modules():
        if isinstance(module, Int8Linear):
            expected = Int8Linear.quantize(plain_modules[name].weight, dtype)
            assert torch.equal(module.int8_weight(), expected["weight_int8"]), name
            assert torch.equal(module.scale, expected["scale"]), name
            x = torch.randn(1, 1, module.in_features).to(dtype)
            assert cosine(module(x), plain_modules[name](x)) > 0.999, name
            count += 1
    # Every linear of the two transformers, whichever layout the plain load stored it in
    assert count == sum(isinstance(module, (torch.nn.Linear, InputMajorLinear))
                        for part in QUANTIZED_PARTS
                        for module in getattr(plain, part).modules())
    for key, tensor in quantized.state_dict().items():  # everything else: as loaded
        if key in plain.state_dict():
            assert torch.equal(tensor, plain.state_dict()[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", ["none", "int8", "int8-weights", "int4", "fp8"])
def test_weight_arithmetic_is_what_loading_allocates(golden_dir, dtype, quantize):
    lm = load_lm(golden_dir, torch.device("cpu"), dtype, quantize=quantize)
    import json

    arch_lm = dict(Arch().lm, **json.loads((golden_dir.path / "personaplex-arch.json")
                                           .read_text())["lm"])
    cpu = torch.device("cpu")
    assert lm_weight_bytes(arch_lm, lm.dep_steps, dtype, quantize, cpu) == tensor_bytes(lm)


def test_kv_arithmetic_is_what_a_stream_allocates(golden_dir):
    import json

    from personaplex_cli.core.mimi import Mimi
    from personaplex_cli.model.load import load_mimi

    lm = load_lm(golden_dir, torch.device("cpu"), torch.float32)
    mimi, _ = load_mimi(golden_dir, torch.device("cpu"))
    states = [lm.temporal_state(1), lm.depformer_state(1), mimi.encoder_state(1),
              mimi.decoder_state(1)]
    rings = sum(t.numel() * t.element_size() for state in states for ring in state.values()
                for t in vars(ring).values() if isinstance(t, torch.Tensor) and t.dim() == 4)
    data = json.loads((golden_dir.path / "personaplex-arch.json").read_text())
    arch_lm = dict(Arch().lm, **data["lm"])
    transformer = dict(Arch().mimi.transformer, **data["mimi"]["transformer"])
    assert kv_bytes_per_stream(arch_lm, transformer, torch.float32) == rings
    assert isinstance(mimi, Mimi)


def test_real_size_arithmetic():
    """The 7B as loaded: 7.69 B parameters with 8 of 16 depformer steps (quantization.md
    rounds it to 7.70), so 15.4 GB of bf16, of which the 7.19 B values of the transformers'
    linears take one byte each in int8; a 3000-frame window of 1.57 GB per stream."""
    arch = Arch()
    bf16 = lm_weight_bytes(arch.lm, 8, torch.bfloat16, "none")
    int8 = lm_weight_bytes(arch.lm, 8, torch.bfloat16, "int8")
    assert abs(bf16 / 2 - 7.69e9) < 0.005e9
    assert abs((bf16 - int8) - 7.19e9) < 0.01e9
    kv = kv_bytes_per_stream(arch.lm, arch.mimi.transformer, torch.bfloat16)
    assert 1.57e9 < kv < 1.6e9
    # int4: half a byte per weight and a bf16 scale and zero per 64 of them; the whole LM
    # at most 0.45 of its bf16 bytes
    int4 = lm_weight_bytes(arch.lm, 8, torch.bfloat16, "int4")
    assert abs((bf16 - int4) - 7.19e9 * (2 - 0.5 - 4 / INT4_GROUP)) < 0.02e9
    assert int4 <= 0.45 * bf16


def test_check_fits_names_the_change_that_fits():
    arch = Arch()
    cpu = torch.device("cpu")
    need = memory_need(arch, arch.lm, 8, cpu, torch.bfloat16, "none")
    int8 = memory_need(arch, arch.lm, 8, cpu, torch.bfloat16, "int8")
    assert check_fits(arch, arch.lm, 8, cpu, torch.bfloat16, "none",
                      available=need.total) == need
    between = (need.total + int8.total) // 2
    with pytest.raises(DeviceError, match=r"use --quantize int8 \(about"):
        check_fits(arch, arch.lm, 8, cpu, torch.bfloat16, "none", available=between)
    with pytest.raises(DeviceError, match="--dtype bf16 --quantize int8"):
        check_fits(arch, arch.lm, 8, cpu, torch.float32, "none", available=int8.total)
    # A second stream needs its own KV window and the primer's two rows' (one stream primes
    # in its own row).
    with pytest.raises(DeviceError, match="--batch-size 2 "):
        check_fits(arch, arch.lm, 8, cpu, torch.bfloat16, "int8", streams=8,
                   streams_option="--batch-size",
                   available=int8.total + 3 * int8.kv_per_stream)
    int4 = memory_need(arch, arch.lm, 8, cpu, torch.bfloat16, "int4")
    with pytest.raises(DeviceError, match=r"use --quantize int4 \(about"):
        check_fits(arch, arch.lm, 8, cpu, torch.bfloat16, "int8", available=int4.total)
    with pytest.raises(DeviceError, match="machine with more.*--quantize int4 with one"):
        check_fits(arch, arch.lm, 8, cpu, torch.bfloat16, "int8", available=GIB)


def test_sessions_that_fit(golden_dir):
    need = MemoryNeed(weights=10, kv_per_stream=3, streams=1, mimi=1, margin=2)
    # The runtime's primer holds one stream's rings per row beside the sessions: a row per
    # session up to PRIMER_ROWS (4), none beside one session (its row primes in place).
    assert sessions_that_fit(need, 15) == 0
    assert sessions_that_fit(need, 16) == 1
    assert sessions_that_fit(need, 22) == 1  # a second session needs three windows more
    assert sessions_that_fit(need, 25) == 2
    assert sessions_that_fit(need, 13 + 3 * 12) == 8
    assert sessions_that_fit(need, 13 + 3 * 11) == 7
    assert need.total == 10 + 3 + 1 + 2
    from personaplex_cli.model.model import Model

    model = Model(golden_dir, torch.device("cpu"), torch.float32)
    one = model.preflight(available=10 * GIB)
    room = one.weights + one.mimi + one.margin
    assert model.sessions_that_fit(room + 9 * one.kv_per_stream + 1) == 5
    assert Model(golden_dir, torch.device("cpu"), torch.float32, quantize="int8"
                 ).preflight(available=10 * GIB).weights < one.weights


# -- safetensors, one tensor at a time --------------------------------------------------------

def test_read_tensor_reads_rows_without_the_rest(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(24, dtype=torch.float32).view(6, 4),
               "b": torch.arange(10).to(torch.bfloat16), "c": torch.tensor(7, dtype=torch.int64)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    entries = read_header(path)
    with open(path, "rb") as fh:
        assert torch.equal(read_tensor(fh, entries["a"]), tensors["a"])
        assert torch.equal(read_tensor(fh, entries["a"], (2, 4)), tensors["a"][2:4])
        assert torch.equal(read_tensor(fh, entries["b"]), tensors["b"])
        assert torch.equal(read_tensor(fh, entries["c"]), tensors["c"])


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:5], "too short"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b"\xff" * 8 + b[8:], "bad header length"),
    (lambda b: b[:8] + b"[" + b[9:], "unreadable"),
])
def test_a_damaged_file_is_named_before_loading(tmp_path, damage, message):
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(3, 3)}, str(path))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(TensorFileError, match=message):
        read_header(path)


# -- before loading: the CLI's checks -------------------------------------------------------

def _model_folder(root: Path, lm: dict | None = None, tokenizer: Path | None = None) -> Path:
    """The golden files in a folder, with the LM's architecture changed by `lm`; a changed
    architecture gets a stand-in checkpoint (one tensor), as the checks run before loading."""
    import json

    from safetensors.torch import save_file

    root.mkdir()
    for name in ("tokenizer-tiny-mimi.safetensors", "tokenizer_spm_tiny_512.model",
                 "model.safetensors"):
        if name.endswith(".model") and tokenizer is not None:
            (root / name).symlink_to(tokenizer)
        elif name == "model.safetensors" and lm:
            save_file({"out_norm.alpha": torch.ones(1, 1, 4)}, str(root / name))
        else:
            (root / name).symlink_to(ASSETS / name)
    arch = json.loads((ASSETS / "personaplex-arch.json").read_text())
    arch["lm"].update(lm or {})
    (root / "personaplex-arch.json").write_text(json.dumps(arch))
    (root / "voices").mkdir()
    return root


def _tokenizer(path: Path, pieces: int) -> Path:
    import sentencepiece as spm

    words = [f"w{a}{b}{c}" for a in "abcdefgh" for b in "abcdefgh" for c in "abcdefgh"]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]),
        model_prefix=str(path), vocab_size=pieces, model_type="word", minloglevel=2)
    return path.with_suffix(".model")


def test_reply_refuses_what_cannot_run_before_loading(run_cli, speech_wav, tmp_path):
    out = tmp_path / "out.wav"
    # fp8 on a device without fp8
    proc = run_cli("reply", speech_wav, out, "-m", _model_folder(tmp_path / "fp8"),
                   "--voice", "", "--device", "cpu", "--quantize", "fp8")
    assert proc.returncode == 5, proc.stderr
    assert b"compute capability 8.9" in proc.stderr and b"--quantize int8" in proc.stderr
    # a tokenizer that is not the LM's: 300 pieces for a text vocabulary of 512
    other = _tokenizer(tmp_path / "other", 300)
    proc = run_cli("reply", speech_wav, out, "-m", _model_folder(tmp_path / "tok",
                                                                  tokenizer=other),
                   "--voice", "", "--device", "cpu")
    assert proc.returncode == 6, proc.stderr
    assert b"has 300 pieces but the language model's text vocabulary is 512" in proc.stderr
    # a model far larger than any memory: 400 layers of dim 4096 (not a byte of it exists)
    huge = {"dim": 4096, "num_heads": 32, "num_layers": 400, "dep_q": 16}
    proc = run_cli("reply", speech_wav, out, "-m", _model_folder(tmp_path / "huge", huge),
                   "--voice", "", "--device", "cpu")
    assert proc.returncode == 5, proc.stderr
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "the model needs about" in lines[0], lines
    assert "GiB weights" in lines[0] and "is available" in lines[0]
    assert b"Traceback" not in proc.stderr and not out.exists()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_loading_leaves_nothing_of_the_checkpoint_mapped(golden_dir, quantize):
    """The LM's file is read, never mapped: loaded weights are the process's own memory, and
    a tensor dropped after quantizing leaves nothing behind (safetensors' own loader hands
    out tensors backed by a mapping of the whole file)."""
    lm = load_lm(golden_dir, torch.device("cpu"), torch.float32, quantize=quantize)
    checkpoint = str((golden_dir.path / "model.safetensors").resolve())
    assert checkpoint not in Path("/proc/self/maps").read_text()
    assert sum(p.numel() for p in lm.parameters()) > 0


@pytest.mark.parametrize("dtype,quantize,least_cosine,same_token", [
    (torch.float32, "int8", 0.999, 0.9), (torch.bfloat16, "int8", 0.998, 0.9),
    (torch.float32, "int8-weights", 0.999, 0.9), (torch.bfloat16, "int8-weights", 0.999, 0.9),
    (torch.float32, "int4", 0.9, 0.6), (torch.bfloat16, "int4", 0.9, 0.6)])
def test_quantized_lm_answers_like_the_unquantized_one(golden_dir, dtype, quantize,
                                                      least_cosine, same_token):
    """The whole quantized LM on the golden tiny checkpoint, fed the same 40 frames of input
    embeddings and depformer tokens as the unquantized one: its logits stay close and its
    greedy tokens mostly agree (bench/quantize_quality.py measures this over 200 frames).
    int8 in bf16 quantizes the activations of bf16 rows too: its least cosine over these
    random inputs was 0.9985 where int8-weights kept 0.999."""
    plain = load_lm(golden_dir, torch.device("cpu"), dtype)
    quantized = load_lm(golden_dir, torch.device("cpu"), dtype, quantize=quantize)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 1, 1, plain.transformer.layers[0].norm1.alpha.shape[-1],
                    generator=generator).to(dtype)
    # step 0 reads a text token, the others audio codes: ids both vocabularies have
    prev = torch.randint(0, min(plain.card, plain.text_card), (40, plain.dep_steps),
                         generator=generator)
    texts, audios = [], []
    for lm in (plain, quantized):
        temporal, depth = lm.temporal_state(1), lm.depformer_state(1)
        text, audio = [], []
        for t in range(40):
            context, logits = lm.forward_embeddings(x[t], temporal)
            text.append(logits.float())
            depth.reset()
            for step in range(lm.dep_steps):
                audio.append(lm.depformer_logits(step, prev[t, step:step + 1], context,
                                                 depth).float())
        texts.append(torch.cat(text))
        audios.append(torch.cat(audio))
    for ref, got in ((texts[0], texts[1]), (audios[0], audios[1])):
        assert torch.isfinite(got).all()
        assert F.cosine_similarity(ref, got, dim=1).min() > least_cosine
        assert (ref.argmax(dim=1) == got.argmax(dim=1)).float().mean() > same_token
    # The KV window keeps the compute dtype: quantization changes only how weights are stored
    # (and, on the CPU, the order the keys are stored in: BlockKVRing).
    from personaplex_cli.core.layers import BlockKVRing

    rings = [r for r in quantized.temporal_state(1).values() if isinstance(r, BlockKVRing)]
    assert len(rings) == len(quantized.transformer.layers)
    assert all(r.key_blocks.dtype == r.values.dtype == dtype for r in rings)


# -- what loading holds: the count, not more ---------------------------------------------------

LOAD_MEMORY = r"""
import json, re, sys
from pathlib import Path
import torch
from personaplex_cli.doctor.bench import bench_arch, random_source
from personaplex_cli.model.load import build_lm
from personaplex_cli.model.memory import lm_weight_bytes

def status(field):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024

torch.set_grad_enabled(False)
lm_arch = dict(bench_arch("tiny").lm, dim=1024, num_heads=8, num_layers=8, text_card=512)
cpu = torch.device("cpu")
source = random_source(lm_arch, cpu, torch.bfloat16, 0)
with torch.device("meta"):
    from personaplex_cli.core.lm import LMModel
    largest = max(t.numel() for t in LMModel(lm_arch, 8, torch.bfloat16).state_dict().values())
torch.nn.Linear(256, 256)(torch.ones(2, 256))  # torch's first use maps pages of its own
# What the load holds is anonymous memory: the pages of torch's libraries its kernels
# first touch (int4's packing) are file-backed, shared, and vary from run to run.
held = status("RssAnon")
base = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
lm = build_lm(lm_arch, 8, cpu, torch.bfloat16, sys.argv[1], source)
print(json.dumps({"count": lm_weight_bytes(lm_arch, 8, torch.bfloat16, sys.argv[1], cpu),
                  "largest": 2 * largest, "rss": status("RssAnon") - held,
                  "peak": status("VmHWM") - base}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_loading_holds_the_count_and_one_tensor_at_a_time(quantize):
    """A 270 MB LM (dim 1024, 8 layers) loaded through the loader reply uses, in a fresh
    process: what it holds after loading is model/memory.py's count of its weights (the
    temporaries of quantizing are handed back to the system, not kept in malloc's heaps),
    and its peak on the way is the count plus a few of the source's largest tensor, the
    one being quantized (not the heap's leftovers of every tensor before it, nor the whole
    source at once). Measured on a quiet 2-core machine, 13 fresh processes for int8: the
    peak over the count was 2.33 to 3.59 of the largest tensor (it varies with what the C
    allocator hands back between tensors, with 1 thread as with 2); before the loader
    handed its temporaries back it was 5.3, and all the source at once would be about 25."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", LOAD_MEMORY, quantize], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    mib = 2 ** 20
    assert got["rss"] <= 1.03 * got["count"] + 4 * mib, got
    assert got["peak"] <= got["count"] + 4.5 * got["largest"], got


def test_reply_runs_with_int4_weights(run_cli, speech_wav, tmp_path):
    """--quantize int4 through the command line: the golden tiny model's linears packed for
    torch's int4 kernel (or unpacked per call where their shapes do not fit it)."""
    import soundfile

    out = tmp_path / "out.wav"
    proc = run_cli("reply", speech_wav, out, "-m", _model_folder(tmp_path / "int4"),
                   "--voice", "", "--device", "cpu", "--quantize", "int4", "--greedy",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    audio, rate = soundfile.read(out)
    assert rate == 24000 and len(audio) > 0 and abs(audio).max() > 0
