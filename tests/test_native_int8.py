"""The int8 kernel built on this machine (model/native.py, rows.c): built once into the
cache, used only where it answers right, and fbgemm's kernel where it cannot be built.
Its arithmetic against fbgemm's: tests/test_quantize.py."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from personaplex_cli.core import quantize
from personaplex_cli.model import native


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """native_int8() with nothing remembered, its cache in tmp_path, and core/quantize.py's
    choice of kernel put back afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in ("_NATIVE", "_PACK_NATIVE", "_DIRECT_OPS"):
        monkeypatch.setattr(quantize, name, getattr(quantize, name))
    native.native_int8.cache_clear()
    native.direct_ops.cache_clear()
    yield tmp_path / "personaplex" / "native"
    native.native_int8.cache_clear()
    native.direct_ops.cache_clear()


def can_build() -> bool:
    return native.cpu_has_vnni() and native.c_compiler() is not None


needs_build = pytest.mark.skipif(not can_build(),
                                 reason="needs AVX-512 VNNI and a C compiler")


@needs_build
def test_built_once_then_loaded_from_the_cache(fresh, monkeypatch):
    kernel = native.native_int8()
    assert kernel.library is not None and "built with" in kernel.why
    [library] = fresh.iterdir()  # one file, no partial one beside it
    assert library.suffix == ".so" and library.name.startswith("rows-")
    native.native_int8.cache_clear()

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    again = native.native_int8()
    assert again.library is not None and "cached at" in again.why
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    line = native.native_line(cpu, "int8", bf16)
    assert line.startswith("int8 kernel: personaplex's, AVX-512 VNNI")
    assert native.native_line(cpu, "none", bf16) is None
    assert native.native_line(cpu, "int4", torch.float32) is None
    if again.bf16 is not None:  # the bf16 linears of int8 and int4 models alike
        assert "the bf16 linears' too" in line
        assert native.native_line(cpu, "int4", bf16).startswith(
            "bf16 linears' kernel: personaplex's")
    assert native.native_kernel_for(torch.device("cuda"), "int8") is None


def test_without_a_compiler_fbgemm_runs_and_says_why(fresh, monkeypatch):
    monkeypatch.setattr(native, "c_compiler", lambda: None)
    monkeypatch.setattr(native, "cpu_has_vnni", lambda: True)
    kernel = native.native_int8()
    assert kernel.library is None and "no C compiler" in kernel.why
    assert native.native_kernel_for(torch.device("cpu"), "int8") is None
    native.use_native_int8(torch.device("cpu"), "int8")
    assert quantize.int8_kernel(torch.device("cpu"), 1024, True) != "native"
    assert "no C compiler" in native.native_line(torch.device("cpu"), "int8", torch.bfloat16)
    assert not fresh.exists()


def test_a_failed_build_leaves_nothing_and_falls_back(fresh, monkeypatch, tmp_path):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such flag' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(native, "c_compiler", lambda: str(broken))
    monkeypatch.setattr(native, "cpu_has_vnni", lambda: True)
    kernel = native.native_int8()
    assert kernel.library is None and kernel.why == "cc failed: cc: error: no such flag"
    assert list(fresh.iterdir()) == []  # the partial output is gone
    native.native_int8.cache_clear()
    monkeypatch.setattr(native, "c_compiler", lambda: "/bin/false")  # fails saying nothing
    assert native.native_int8().why == "false failed (exit status 1)"


def test_other_cpus_are_not_built_for(fresh, monkeypatch):
    monkeypatch.setattr(native, "cpu_has_vnni", lambda: False)
    kernel = native.native_int8()
    assert kernel.library is None and "no AVX-512 VNNI" in kernel.why
    assert not fresh.exists()


@needs_build
def test_a_library_that_answers_wrongly_is_not_used(fresh, monkeypatch):
    right = native.NativeInt8.__call__
    monkeypatch.setattr(native.NativeInt8, "__call__",
                        lambda self, rows, *packed: right(self, rows, *packed) * 1.0001)
    kernel = native.native_int8()
    assert kernel.library is None and "answers a test product wrongly" in kernel.why


OPENMP_MAPPED = """
import torch
from personaplex_cli.model.native import native_int8

def openmp():
    return {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}

torch.ones(64, 64) @ torch.ones(64, 64)
before = openmp()
assert native_int8().library is not None
print(" ".join(sorted(before)))
print(" ".join(sorted(openmp())))
"""


@needs_build
def test_one_openmp_runtime_and_any_calling_thread(fresh):
    """The library's OpenMP is torch's libgomp, and a thread other than the one that built
    it gets the same answer (the thread count is passed each call)."""
    import threading

    import sys

    kernel = native.NativeInt8(native.native_int8().library)
    # In a fresh process: loading the library maps no OpenMP runtime besides torch's (other
    # wheels may bring their own copies, sentencepiece's for one).
    proc = subprocess.run([sys.executable, "-c", OPENMP_MAPPED], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    before, after = (set(line.split()) for line in proc.stdout.splitlines())
    assert after == before and any("torch" in path for path in before), (before, after)
    weight = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
    packed = kernel.pack(weight, torch.rand(64))
    rows = torch.randn(2, 128)
    expected = kernel(rows, *packed)
    answers = []
    worker = threading.Thread(target=lambda: answers.append(kernel(rows, *packed)))
    worker.start()
    worker.join()
    assert torch.equal(answers[0], expected)


# -- the C++ operators compiled code calls (rows_op.cpp) -------------------------------------

def cxx() -> str | None:
    import shutil

    return shutil.which("g++") or shutil.which("clang++")


needs_cxx = pytest.mark.skipif(not can_build() or cxx() is None,
                               reason="needs AVX-512 VNNI, a C compiler and a C++ compiler")


@needs_cxx
def test_the_cpp_operators_give_the_kernels_bits(fresh):
    """personaplex::int8_rows and bf16_rows are the kernel called from C++: the same bits
    as through ctypes, for fp32 and bf16 rows, one row and several, widths that fill no
    whole tile, and rows that are a view of a wider tensor; once they load, the compiled
    step calls them (quantize._DIRECT_OPS)."""
    assert native.direct_ops(cxx()) is None and quantize._DIRECT_OPS
    built = native.native_int8()
    generator = torch.Generator().manual_seed(3)
    for n, k in ((37, 200), (1024, 1024), (3072, 1024)):
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        packed = built.kernel.pack(weight, torch.rand(n, generator=generator) / 100)
        tiles = built.bf16.pack(torch.randn(n, k, generator=generator).bfloat16())
        for m in (1, 3, 8):
            wide = torch.randn(m, 2 * k, generator=generator)
            for dtype in (torch.float32, torch.bfloat16):
                rows = wide.to(dtype)[:, :k]  # not contiguous
                want = built.kernel(rows.contiguous(), *packed)
                assert torch.equal(torch.ops.personaplex.int8_rows(rows, *packed), want)
            rows = wide.bfloat16()[:, :k]
            want = built.bf16.bind(tiles, n)(rows.contiguous())
            got = torch.ops.personaplex.bf16_rows(rows, tiles, torch.empty(n))
            assert got.shape == (m, n) and torch.equal(got, want)


OPS_WITHOUT_A_CXX = """
import sys
from personaplex_cli.core import quantize
from personaplex_cli.model import native
assert native.native_int8().library is not None
print(native.direct_ops(sys.argv[1]))
print(quantize._DIRECT_OPS)
"""


@needs_build
def test_without_the_cpp_operators_compiled_code_calls_the_python_ones(fresh, tmp_path):
    """A C++ compiler that fails: direct_ops says why in one line, leaves no file, and the
    compiled step keeps calling the Python operators, under a cache key of its own."""
    import sys

    from personaplex_cli.model.compiled import int8_kernel_key

    broken = tmp_path / "c++"
    broken.write_text("#!/bin/sh\necho 'In file included from x.h' >&2\n"
                      "echo 'rows_op.cpp:1: error: no torch here' >&2\nexit 1\n")
    broken.chmod(0o755)
    proc = subprocess.run([sys.executable, "-c", OPS_WITHOUT_A_CXX, str(broken)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["c++ failed: rows_op.cpp:1: error: no torch here",
                                        "False"]
    assert not [f for f in fresh.iterdir() if f.name.startswith(("rows_op", ".rows_op"))]
    assert int8_kernel_key(True, True, False) == "native + bf16 tiles"
    assert int8_kernel_key(True, True, True) == "native + bf16 tiles + C++ operators"
    assert int8_kernel_key(False, False, True) == "torch's"
