"""The depformer's frame: one product projects the context for every step, each step's ring
slot and mask made once, the draws' parameters read once a frame, all of it the arithmetic
of the loop it replaced, bit for bit; and --compile (model/compiled.py): where it compiles,
and that the compiled steps answer as the eager ones (one small case, compiled once)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from personaplex_cli.errors import DeviceError
from personaplex_cli.model.files import ModelDir
from personaplex_cli.model.load import load_lm

ASSETS = Path(__file__).parent / "data" / "golden" / "assets"
torch.set_grad_enabled(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_product_projects_the_context_for_every_step(golden_dir, dtype):
    """The loaded LM's steps' input projections are views of one fused weight (no second
    copy: the count stays the loaded bytes), and its one product gives each step's own
    product bit for bit."""
    from personaplex_cli.model.memory import lm_weight_bytes, tensor_bytes

    lm = load_lm(golden_dir, torch.device("cpu"), dtype)
    fused = lm.depformer_in_fused
    start, end = fused.data_ptr(), fused.data_ptr() + fused.numel() * fused.element_size()
    assert all(start <= linear.weight.data_ptr() < end for linear in lm.depformer_in)
    assert tensor_bytes(lm) == lm_weight_bytes(dict(lm_arch(golden_dir)), lm.dep_steps,
                                                dtype, "none")
    context = torch.randn(3, 1, lm.dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    together = lm.depformer_inputs(context)
    assert together.shape == (3, lm.dep_steps, 1, lm.depformer_in[0].out_features)
    for step, linear in enumerate(lm.depformer_in):
        assert torch.equal(together[:, step], F.linear(context, linear.weight)), step


def lm_arch(golden_dir: ModelDir) -> dict:
    import json

    from personaplex_cli.core.config import Arch

    data = json.loads((golden_dir.path / "personaplex-arch.json").read_text())
    return dict(Arch().lm, **data["lm"])


def loop_before(gen, context, text_logits, target, forced, text_noise, audio_noise):
    """The generator's depformer loop before it was restructured (issue 33): each step's
    own input projection, Transformer.forward with its window bookkeeping, the draws'
    parameters read at every draw."""
    from personaplex_cli.core.sampling import sample_rows

    s, lm = gen.sampling, gen.lm
    text_noise, audio_noise = s.with_keyed(gen.offset, text_noise, audio_noise)
    text = sample_rows(text_logits, s.temp[0], s.top_k[0], s.greedy[0], text_noise)
    prev = torch.where(forced[:, 0], target[:, 0], text)
    gen.depth.reset()
    sampled, logits = [text], []
    for k in range(lm.dep_steps):
        emb = lm.depformer_text_emb if k == 0 else lm.depformer_emb[k - 1]
        x = lm.depformer_in[k](context) + emb(prev)[:, None]
        logits.append(lm.linears[k](lm.depformer(x, gen.depth, k))[:, 0])
        token = sample_rows(logits[-1], s.temp[1], s.top_k[1], s.greedy[1], audio_noise[:, k])
        prev = torch.where(forced[:, 1 + k], target[:, 1 + k], token)
        sampled.append(token)
    return torch.stack(sampled, dim=1), torch.stack(logits)


@pytest.mark.parametrize("dtype,quantize", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                            (torch.bfloat16, "int8")])
def test_the_frame_s_depformer_is_the_loop_it_replaced(golden_dir, dtype, quantize):
    """Four rows sampling by NVIDIA's defaults (one greedy, one taking every token, one
    forced), frame after frame: the restructured frame gives the old loop's tokens and its
    logits bit for bit (fp32 attends over the written slots only, bf16 over the whole ring:
    both as before)."""
    from personaplex_cli.core.generator import FrameGenerator
    from personaplex_cli.core.sampling import Sampling

    lm = load_lm(golden_dir, torch.device("cpu"), dtype, quantize=quantize)
    gen = FrameGenerator(lm, 4, trim=dtype == torch.float32)
    for row, sampling in enumerate((Sampling(), Sampling(greedy=True), Sampling(top_k_audio=0),
                                    Sampling())):
        gen.set_sampling(row, sampling, 10 + row)
    generator = torch.Generator().manual_seed(1)
    recorded = []
    step = lm.depformer_step

    def recording(k, prev, *rest):
        recorded.append(step(k, prev, *rest))
        return recorded[-1]

    lm.depformer_step = recording
    for frame in range(3):
        context = torch.randn(4, 1, lm.dim, generator=generator).to(dtype)
        text_logits = torch.randn(4, lm.text_card, generator=generator).to(dtype)
        target = torch.randint(0, lm.card, (4, lm.num_streams), generator=generator)
        forced = torch.zeros(4, lm.num_streams, dtype=torch.bool)
        forced[3, 2:5] = True
        noise = gen.sampling.draw_generators()
        gen.offset += 1  # the keyed noise follows each row's frame
        recorded.clear()
        tokens = gen._sample(context, text_logits, target, forced, *noise)
        want_tokens, want_logits = loop_before(gen, context, text_logits, target, forced,
                                               *noise)
        assert torch.equal(tokens, want_tokens), frame
        assert torch.equal(torch.stack(recorded), want_logits), frame
    assert len({tuple(row) for row in tokens.tolist()}) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_attention_answers_as_the_fused_kernel(dtype):
    """What compiled code runs for one query over the depformer's few slots (in place of
    torch's fused kernel, 60 to 70 us a call in a compiled frame): the fused kernel's answer
    to float rounding, with a mask of booleans as with one added to the scores, 1 to 3 rows,
    slots seen from one to all."""
    from personaplex_cli.core.layers import short_attention

    generator = torch.Generator().manual_seed(2)
    for rows in (1, 3):
        for seen in (1, 9, 17):
            q, keys, values = (torch.randn(rows, 16, s, 64, generator=generator).to(dtype)
                               for s in (1, 17, 17))
            mask = (torch.arange(17) < seen).view(1, 1, 1, 17).expand(rows, -1, -1, -1)
            added = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
            want = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).float()
            tolerance = 2e-6 if dtype == torch.float32 else 2 ** -7
            for given in (mask, added):
                got = short_attention(q, keys, values, given)
                assert got.dtype == dtype and got.shape == q.shape
                assert (got.float() - want).abs().max() <= tolerance * want.abs().max()


# -- --compile ---------------------------------------------------------------------------------

def test_where_compile_applies(monkeypatch, tmp_path):
    """auto compiles quantized CPU models only, where a C++ compiler is found and the cache
    can be written; on compiles any CPU model or is refused (exit 5) with the reason; off
    never; off the CPU, CUDA's graphs stand instead."""
    from personaplex_cli.model import compiled
    from personaplex_cli.model.compiled import plan_compile

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "cxx_compiler", lambda: "/usr/bin/g++")
    assert plan_compile("auto", cpu, "int8").enabled
    assert plan_compile("auto", cpu, "int4").enabled
    assert plan_compile("on", cpu, "none").enabled
    unquantized = plan_compile("auto", cpu, "none")
    assert not unquantized.enabled and "bit for bit" in unquantized.why
    assert not plan_compile("off", cpu, "int8").enabled
    assert not plan_compile("auto", cuda, "int8").enabled
    with pytest.raises(DeviceError, match="--compile on is for the CPU"):
        plan_compile("on", cuda, "int8")
    plan = plan_compile("auto", cpu, "int8")
    assert plan.cache == tmp_path / "cache" / "personaplex" / "compiled" and plan.cache.is_dir()
    monkeypatch.setattr(compiled, "cxx_compiler", lambda: None)
    assert plan_compile("auto", cpu, "int8").why == "no C++ compiler found"
    with pytest.raises(DeviceError, match="needs a C\\+\\+ compiler"):
        plan_compile("on", cpu, "int8")
    monkeypatch.setattr(compiled, "cxx_compiler", lambda: "/usr/bin/g++")
    monkeypatch.setattr(compiled, "writable", lambda folder: False)
    assert not plan_compile("auto", cpu, "int8").enabled
    with pytest.raises(DeviceError, match="cannot write the compile cache"):
        plan_compile("on", cpu, "int8")
    monkeypatch.undo()
    monkeypatch.setattr(compiled, "writable", lambda folder: True)
    monkeypatch.setattr(compiled, "saves_compiled_functions", lambda: False)
    assert "cannot save compiled code" in plan_compile("auto", cpu, "int8").why
    with pytest.raises(DeviceError, match="compiles ahead of time"):
        plan_compile("on", cpu, "int8")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert compiled.cxx_compiler() is None


def test_a_failed_compile_is_one_line_and_a_foreign_file_compiles_again(golden_dir, tmp_path,
                                                                        monkeypatch):
    """Inductor failing is exit 5 with one line naming --compile off, and a saved step
    that does not load (another build's) is compiled again, not an error."""
    from personaplex_cli.model import compiled
    from personaplex_cli.model.compiled import (CompilePlan, compile_lm, compile_shape,
                                                load_steps, step_file)

    lm = load_lm(golden_dir, torch.device("cpu"), torch.float32, dep_steps=2, quantize="int8")
    plan = CompilePlan("on", True, "test", "/usr/bin/g++", tmp_path / "compiled")
    shape = compile_shape(lm_arch(golden_dir), 2, torch.float32, "int8", (1,))

    def fails(lm, batch, files):
        raise RuntimeError("C++ compile error: something\nand more lines")

    monkeypatch.setattr(compiled, "compile_steps", fails)
    with pytest.raises(DeviceError) as caught:
        compile_lm(lm, plan, shape)
    assert "\n" not in str(caught.value) and "--compile off" in str(caught.value)
    assert "C++ compile error: something" in str(caught.value)
    assert lm.depformer_compiled is None
    foreign = step_file(plan.folder(shape), 1, 0)
    foreign.write_bytes(b"not a compiled function")
    assert load_steps([foreign]) is None
    compiled_again = []
    monkeypatch.setattr(compiled, "compile_steps",
                        lambda lm, batch, files: compiled_again.append(batch) or [None, None])
    monkeypatch.setattr(compiled, "compile_temporal", lambda lm, file: [None])
    step_file(plan.folder(shape), 1, 1).write_bytes(b"")
    compile_lm(lm, plan, shape)
    assert compiled_again == [1]


def test_compile_is_off_unless_asked_for(monkeypatch):
    """The first run compiles for up to five minutes on a 2-core machine, for about 60 ms of
    a 480 ms int8 step there: every command, the Model and serve's Server default to off,
    which compiles nothing even where a compiler is found (PERSONAPLEX_COMPILE unset)."""
    import inspect

    from typer.main import get_command

    from personaplex_cli.cli.app import app
    from personaplex_cli.core.config import DEFAULT_COMPILE
    from personaplex_cli.model import compiled
    from personaplex_cli.model.model import Model
    from personaplex_cli.serve.server import Server

    assert DEFAULT_COMPILE == "off"
    monkeypatch.delenv("PERSONAPLEX_COMPILE", raising=False)
    commands = get_command(app).commands
    for name in ("reply", "talk", "serve", "doctor"):
        option = next(p for p in commands[name].params if "--compile" in p.opts)
        assert option.default.value == "off", name
    for function in (Model.__init__, Model.open, Server.open):
        assert inspect.signature(function).parameters["compile_mode"].default == "off"
    monkeypatch.setattr(compiled, "cxx_compiler", lambda: "/usr/bin/g++")
    assert not compiled.plan_compile(DEFAULT_COMPILE, torch.device("cpu"), "int8").enabled


def test_compile_on_without_a_compiler_is_one_line(run_cli, tmp_path):
    """reply --compile on with no compiler: exit 5 and one line naming the way out, before
    anything loads."""
    from conftest import golden_model_folder

    folder = golden_model_folder(tmp_path / "model")
    proc = run_cli("reply", str(ASSETS / "input.wav"), str(tmp_path / "out.wav"), "-m",
                   str(folder), "--device", "cpu", "--quantize", "int8", "--compile", "on",
                   env={"CXX": "no-such-compiler-here", "PERSONAPLEX_COMPILE": None})
    assert proc.returncode == 5, proc.stderr
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "needs a C++ compiler" in lines[0] and "--compile off" in lines[0]
    assert not (tmp_path / "out.wav").exists()


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="no C++ compiler")
def test_the_compiled_steps_answer_as_the_eager_ones(golden_dir, tmp_path, monkeypatch):
    """The one case CI compiles (2 depformer steps of the golden tiny, int8, fp32, for one
    row and for more, and its temporal step for one row; a minute on a busy 2-core
    machine): the compiled steps' logits equal the eager ones' to float rounding and their
    greedy tokens are the same, at batch 1 and 3, frame after frame on one state, and so
    do the temporal step's context and text logits (3 rows run it eager); the functions are
    saved where the plan says, and a later run, at another thread count, loads them and
    compiles nothing."""
    from personaplex_cli.model import compiled as compiled_module
    from personaplex_cli.core.graphs import make_generator
    from personaplex_cli.core.sampling import RowChoice, Sampling
    from personaplex_cli.model.compiled import (CompilePlan, CompiledSteps, CompiledTemporal,
                                                compile_lm, compile_shape, cxx_compiler,
                                                step_file, temporal_file, window_of)

    lm = load_lm(golden_dir, torch.device("cpu"), torch.float32, dep_steps=2, quantize="int8")
    context = torch.randn(3, 1, lm.dim, generator=torch.Generator().manual_seed(5))
    plan = CompilePlan("on", True, "test", cxx_compiler(), tmp_path / "compiled")
    shape = compile_shape(lm_arch(golden_dir), 2, torch.float32, "int8", (1, 2))
    assert plan.first_time(shape) and "compiling the LM's step" in plan.line(shape)

    width = 100  # a top-k other than the 250 the draws were traced with
    noise = torch.empty(3, 3, lm.dep_steps, width).exponential_(
        generator=torch.Generator().manual_seed(6))

    def frames(runner, rows: int) -> list[torch.Tensor]:
        """Three frames' logits and tokens of each step, as the generator feeds the steps:
        row 0 greedy, the others drawn at temperature 0.8 among the top 100 (rows 0 and 2
        forced to token 7 after step 0: the next step reads it)."""
        choice = RowChoice(torch.full((rows,), 0.8), torch.full((rows,), width),
                           torch.arange(rows) == 0, lm.card, width)
        # the codebooks' columns of the frame's [rows, 17], as the generator passes them
        forced = torch.zeros(rows, lm.num_streams, dtype=torch.bool)
        forced[::2, 1] = True
        target = torch.full((rows, lm.num_streams), 7)
        state, out = lm.depformer_state(rows), []
        for frame in range(3):
            state.reset()
            projected = lm.depformer_inputs(context[:rows] + frame)
            prev = torch.zeros(rows, dtype=torch.long)
            for k in range(lm.dep_steps):
                logits, token, prev = runner(k, prev, projected[:, k], state,
                                             *lm.depformer_window(k, state), choice,
                                             noise[frame, :rows], forced[:, 1:],
                                             target[:, 1:])
                out += [logits, token]
                assert torch.equal(prev, torch.where(forced[:, 1 + k], 7, token))
        return out

    def temporal(runner, rows: int) -> list[torch.Tensor]:
        """Four steps' contexts and text logits from one state."""
        state, out = lm.temporal_state(rows), []
        for frame in range(4):
            out += runner(context[:rows] * (frame + 1), state)
        return out

    eager = {rows: frames(lm.depformer_draw, rows) for rows in (1, 3)}
    eager_temporal = {rows: temporal(lm.forward_embeddings, rows) for rows in (1, 3)}
    started = time.perf_counter()
    compile_s = compile_lm(lm, plan, shape)
    assert 0 < compile_s <= time.perf_counter() - started
    assert isinstance(lm.depformer_runner(), CompiledSteps)
    # -v says how the compiled code reaches the kernels built here, and why not through C++
    assert "through C++ operators" in compiled_module.operators_line(lm, plan)
    assert compiled_module.operators_line(lm, CompilePlan("off", False, "off")) is None
    with monkeypatch.context() as patched:
        patched.setattr(compiled_module, "direct_ops", lambda compiler: "c++ failed: x")
        assert compiled_module.operators_line(lm, plan).endswith("through Python (c++ failed: x)")
    assert not plan.first_time(shape) and "cached" in plan.line(shape)
    folder = plan.folder(shape)
    assert folder.parent == tmp_path / "compiled"
    assert all(step_file(folder, batch, k).stat().st_size > 0 for batch in (1, 2)
               for k in range(2))
    assert temporal_file(folder).stat().st_size > 0
    compiled = {rows: frames(lm.depformer_runner(), rows) for rows in (1, 3)}
    for rows in (1, 3):
        for want, got in zip(eager[rows][::2], compiled[rows][::2]):  # logits
            assert (got - want).abs().max() <= 1e-3 * want.abs().max()
            assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))
        for want, got in zip(eager[rows][1::2], compiled[rows][1::2]):  # tokens drawn
            assert torch.equal(got, want)
    # A draw over the whole vocabulary (top-k 0), which the compiled draw was not traced
    # through, runs eager: the eager bits.
    state, whole = lm.depformer_state(1), lm.card
    choice = RowChoice(torch.ones(1), torch.zeros(1, dtype=torch.long),
                       torch.zeros(1, dtype=torch.bool), whole, whole)
    args = (lm.depformer_inputs(context[:1])[:, 0], state, *lm.depformer_window(0, state),
            choice, torch.ones(1, lm.dep_steps, whole),
            torch.zeros(1, lm.dep_steps, dtype=torch.bool),
            torch.zeros(1, lm.dep_steps, dtype=torch.long))
    want = lm.depformer_draw(0, torch.zeros(1, dtype=torch.long), *args)
    state.reset()
    got = lm.depformer_runner()(0, torch.zeros(1, dtype=torch.long), *args)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # The temporal step: compiled for one row, eager (the same arithmetic) for three.
    assert isinstance(lm.temporal_runner(), CompiledTemporal)
    compiled_temporal = temporal(lm.temporal_runner(), 1)
    for want, got in zip(eager_temporal[1], compiled_temporal):
        assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert all(torch.equal(got, want) for want, got in
               zip(eager_temporal[3], temporal(lm.temporal_runner(), 3)))
    # An fp32 generator trims its windows eager, but not where the compiled step reads them.
    gen = make_generator(lm, 1, graphs=False)
    assert window_of(gen.temporal[lm.transformer]) == lm.temporal_compiled.window
    # A frame generator's draws, 3 rows with NVIDIA's sampling (keyed noise) and one forced
    # codebook, pass the compiled steps their tensors as they were traced: its frames'
    # tokens are the eager ones.
    gen = make_generator(lm, 3, graphs=False)
    for row in range(3):
        gen.set_sampling(row, Sampling(), 40 + row)
    target = gen.initial.expand(3, -1).clone()
    target[1, 1] = 5  # row 1's first codebook: what its second step reads
    forced = torch.zeros(3, lm.num_streams, dtype=torch.bool)
    forced[1, 1] = True
    runs = []
    for steps in (compiled_steps := lm.depformer_compiled, None):
        lm.depformer_compiled = steps
        runs.append([gen._sample(context[:3] * frame, context[:3, 0, :lm.text_card] * frame,
                                 target, forced, *gen.sampling.draw_generators())
                     for frame in range(1, 4)])
        # greedy rows alone: the noise one token wide, narrower than any width traced
        for row in range(3):
            gen.set_sampling(row, Sampling(greedy=True), 40 + row)
        runs[-1].append(gen._sample(context[:3], context[:3, 0, :lm.text_card], target,
                                    forced, *gen.sampling.draw_generators()))
        assert runs[-1][-1].shape == (3, 1 + lm.dep_steps)
        for row in range(3):
            gen.set_sampling(row, Sampling(), 40 + row)
    lm.depformer_compiled = compiled_steps
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    # A later run at another thread count (talk's warm-up picks one after loading) loads
    # what the first compiled, and its loops take the new count.
    threads = torch.get_num_threads()
    for name in ("compile_steps", "compile_temporal"):  # calling either would fail
        monkeypatch.setattr(compiled_module, name, None)
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        lm.depformer_compiled = lm.temporal_compiled = None
        compile_lm(lm, plan, shape)
        again = {rows: frames(lm.depformer_runner(), rows) for rows in (1, 3)}
    finally:
        torch.set_num_threads(threads)
    for rows in (1, 3):
        assert torch.allclose(again[rows][-2], compiled[rows][-2], rtol=1e-5, atol=1e-5)
        assert torch.equal(again[rows][-1], compiled[rows][-1])
    assert torch.allclose(temporal(lm.temporal_runner(), 1)[-1], compiled_temporal[-1],
                          rtol=1e-5, atol=1e-5)
