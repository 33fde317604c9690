"""The kernels built on this machine: rows.c, for x86 CPUs with AVX-512 VNNI.

--quantize int8 multiplies each activation row, quantized on its own, with the int8
weights. fbgemm's kernel (core/quantize.py) does it where nothing else can; rows.c does the
same arithmetic to the bit and reads the weights at the memory's rate, which fbgemm's
reaches only on large matrices (bench/int8_kernels.py). rows.c also multiplies the bf16
linears a quantized LM keeps (its text head, the depformer's input projections and heads)
from the same tiles, 1.3 to 2.4 times as fast as F.linear on one row, rounding its own way
(NativeBF16). It is compiled once per
machine with the system's C compiler (under a second, into personaplex's cache, native/)
and loaded with ctypes; before a run uses it, it multiplies a small product whose answer
torch computes too, and a library that answers otherwise is not used. Without a compiler,
on other CPUs, or where the build fails, fbgemm's kernel runs and nothing is said but
with -v (native_line).

Where a run compiles its step (--compile), rows_op.cpp wraps the same two products as torch
operators in C++, built with the C++ compiler against this torch (direct_ops), so that the
compiled code reaches them without Python; without it the Python operators serve."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ..core import quantize
from .files import tool_cache_dir

SOURCE = Path(__file__).with_name("rows.c")
# rows.c's products as torch operators in C++, which compiled code calls without Python
OP_SOURCE = Path(__file__).with_name("rows_op.cpp")
# -O3 for the loops, the AVX-512 subsets the kernels' intrinsics need, OpenMP for the
# threads (the same libgomp torch loaded serves it).
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw",
         "-mavx512dq", "-mavx512vl", "-mavx512vnni")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")
BUILD_SECONDS = 60  # a compiler stuck past this is not waited for


def to_tiles(weight: torch.Tensor, rows: int, line: int) -> torch.Tensor:
    """w [N, K] -> rows.c's layout [N' / rows, K' / line, rows, line], N' and K' padded with
    zeros to whole tiles and groups: each tile one contiguous stretch, 64-byte aligned
    (torch's CPU allocations are), so the rows of a range of tiles are a slice."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // rows) * rows, -(-k // line) * line)
    padded[:n, :k] = weight
    return padded.view(-1, rows, padded.shape[1] // line, line).transpose(1, 2).contiguous()


def from_tiles(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """to_tiles' layout -> w [n, k]."""
    return tiles.transpose(1, 2).reshape(-1, tiles.shape[1] * tiles.shape[3])[:n, :k].contiguous()


def tiled_elements(n: int, k: int, rows: int, line: int) -> int:
    """How many elements to_tiles makes of a weight [n, k]."""
    return -(-n // rows) * rows * (-(-k // line) * line)


class NativeInt8:
    """rows.c's int8 product, as core/quantize.py calls it (core.quantize.use_native_int8):
    pack a layer's weight once, then multiply rows with it."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        pointer, number = ctypes.c_void_p, ctypes.c_int
        library.pp_int8_rows.argtypes = [pointer, number, number, number, number, pointer,
                                         pointer, pointer, number, pointer, number, number]
        library.pp_int8_rows.restype = number
        self.block_rows = library.pp_block_rows()  # output rows per tile of the layout
        self.line = library.pp_line()  # input columns a tile holds of each row in turn

    def pack(self, weight: torch.Tensor, scale: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, K] int8 and its row scales [N] -> (the weight in the kernel's layout
        [N' / block_rows, K' / line, block_rows, line], N' and K' padded with zeros to
        whole tiles and groups; 128 * sum_k q [N] int32; the scales [N] fp32)."""
        blocked = to_tiles(weight, self.block_rows, self.line)
        row_sums = weight.sum(dim=1, dtype=torch.int32).mul_(quantize.ACTIVATION_ZERO_POINT)
        return blocked, row_sums, scale.float().contiguous()

    def stored_bytes(self, n: int, k: int) -> int:
        """What pack makes of a weight [n, k]: its padded layout, row sums and scales."""
        return tiled_elements(n, k, self.block_rows, self.line) + 4 * n + 4 * n

    def unpack(self, blocked: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """pack's layout -> q [n, k]."""
        return from_tiles(blocked, n, k)

    def __call__(self, rows: torch.Tensor, blocked: torch.Tensor, row_sums: torch.Tensor,
                 scale: torch.Tensor) -> torch.Tensor:
        """rows [M, K] fp32 or bf16 -> [M, N] in their dtype."""
        return self.bind(blocked, row_sums, scale)(rows)

    def bind(self, blocked: torch.Tensor, row_sums: torch.Tensor, scale: torch.Tensor):
        """One layer's product as a function of its rows, what can be worked out once worked
        out (a call of the depformer's small layers costs microseconds, 200 a frame)."""
        call, threads = self.library.pp_int8_rows, torch.get_num_threads
        n, padded_k = scale.shape[0], blocked.shape[1] * self.line
        weights = blocked.data_ptr(), row_sums.data_ptr(), scale.data_ptr(), n

        def run(rows: torch.Tensor) -> torch.Tensor:
            if rows.dtype not in (torch.float32, torch.bfloat16) or not rows.is_contiguous():
                return run(rows.float().contiguous()).to(rows.dtype)  # fp16: through fp32
            m, k = rows.shape
            wide = rows.dtype == torch.bfloat16
            out = torch.empty((m, n), dtype=rows.dtype)
            if call(rows.data_ptr(), wide, m, k, padded_k, *weights, out.data_ptr(), wide,
                    threads()):
                raise MemoryError("int8_rows: out of memory for its scratch rows")
            return out

        run.buffers = (blocked, row_sums, scale)  # held while the function is
        return run


class NativeBF16:
    """rows.c's bf16 product, as core/quantize.py's TiledLinear calls it: a bias-free bf16
    linear's weight packed once into tiles, then rows multiplied with it, the sums in fp32
    column by column (not F.linear's rounding; no row depends on the others)."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        pointer, number = ctypes.c_void_p, ctypes.c_int
        library.pp_bf16_rows.argtypes = [pointer, number, number, pointer, number, pointer,
                                         number, number]
        library.pp_bf16_rows.restype = number
        self.block_rows = library.pp_block_rows()
        self.line = 2  # columns of a row in one 32-bit lane

    def takes(self, weight: torch.Tensor) -> bool:
        """Whether a weight [N, K] can be packed: bf16, K whole pairs."""
        return weight.dtype == torch.bfloat16 and weight.shape[1] % self.line == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """w [N, K] bf16 (K whole pairs: takes) -> to_tiles' layout."""
        return to_tiles(weight, self.block_rows, self.line)

    def stored_bytes(self, n: int, k: int) -> int:
        return 2 * tiled_elements(n, k, self.block_rows, self.line)

    def unpack(self, tiles: torch.Tensor, n: int) -> torch.Tensor:
        """pack's layout -> w [n, K]."""
        return from_tiles(tiles, n, tiles.shape[1] * self.line)

    def bind(self, tiles: torch.Tensor, n: int):
        """The product with one packed weight as a function of its rows [M, K] -> [M, n]
        in their dtype (the kernel's are bf16: others go through a bf16 copy)."""
        call, threads = self.library.pp_bf16_rows, torch.get_num_threads
        address = tiles.data_ptr()

        def run(rows: torch.Tensor) -> torch.Tensor:
            if rows.dtype != torch.bfloat16:
                return run(rows.bfloat16()).to(rows.dtype)
            rows = rows.contiguous()
            m, k = rows.shape
            out = torch.empty((m, n), dtype=torch.bfloat16)
            if call(rows.data_ptr(), m, k, address, n, out.data_ptr(), 1, threads()):
                raise MemoryError("bf16_rows: out of memory for its rows widened to fp32")
            return out

        run.buffers = (tiles,)  # held while the function is
        return run


@dataclass(frozen=True)
class NativeKernel:
    """The built library, or why there is none."""

    library: ctypes.CDLL | None
    why: str  # a phrase: where it came from, or why fbgemm's runs instead
    kernel: NativeInt8 | None = None  # the library as core/quantize.py calls it
    bf16: NativeBF16 | None = None  # its bf16 product, where it answers right


def c_compiler() -> str | None:
    """$CC, else cc, gcc or clang on the PATH."""
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        found = shutil.which(name)
        if found:
            return found
    return None


def cpu_has_vnni() -> bool:
    """Whether this CPU has the AVX-512 subsets the kernel uses (Linux reads /proc/cpuinfo;
    elsewhere the library asks the CPU itself once built)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return sys.platform != "linux"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return all(flag in flags for flag in CPU_FLAGS)


def library_file(compiler: str) -> Path:
    """Where the library built by `compiler` from this source lives: per source, flags and
    compiler, so an upgrade of either builds it again."""
    return built_file("rows", SOURCE, [compiler, *FLAGS])


def built_file(name: str, source: Path, command: list[str]) -> Path:
    """Where `source` built by `command` is cached: per source and command."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join(command).encode())
    return tool_cache_dir() / "native" / f"{name}-{digest.hexdigest()[:16]}.so"


def build(command: list[str], target: Path) -> str | None:
    """Runs the compiler `command` (its sources and flags, not the output) into `target`,
    written atomically -> None, or what went wrong."""
    compiler = Path(command[0]).name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}.",
                                       suffix=".so")
        os.close(fd)
    except OSError as error:
        return f"cannot write {target.parent} ({error.strerror})"
    try:
        done = subprocess.run([*command, "-o", partial], capture_output=True, text=True,
                              timeout=BUILD_SECONDS)
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()
            errors = [line for line in said if "error" in line] or said
            return (f"{compiler} failed: {errors[0]}" if errors
                    else f"{compiler} failed (exit status {done.returncode})")
        os.replace(partial, target)
        return None
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{compiler} did not run ({error})"
    finally:
        Path(partial).unlink(missing_ok=True)


def answers_right(kernel: NativeInt8) -> bool:
    """A small product through the kernel against the same arithmetic in torch."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (37, 200), dtype=torch.int8, generator=generator)
    scale = torch.rand(37, generator=generator) / 100
    rows = torch.randn(3, 200, generator=generator)
    a, rows_scale = quantize.quantize_rows(rows)
    expected = (a @ weight.float().T) * scale * rows_scale  # exact: integers below 2**24
    return torch.allclose(kernel(rows, *kernel.pack(weight, scale)), expected,
                          rtol=1e-6, atol=0)


def bf16_answers_right(kernel: NativeBF16) -> bool:
    """A small bf16 product through the kernel against torch's in fp64, within bf16's
    rounding of the answer."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 200, generator=generator).bfloat16()
    rows = torch.randn(3, 200, generator=generator).bfloat16()
    expected = rows.double() @ weight.double().T
    got = kernel.bind(kernel.pack(weight), 37)(rows).double()
    return torch.allclose(got, expected, rtol=2 ** -7, atol=1e-3)


@cache
def native_int8() -> NativeKernel:
    """The kernel for this machine, built the first time (once per process)."""
    if not cpu_has_vnni():
        return NativeKernel(None, "this CPU has no AVX-512 VNNI")
    compiler = c_compiler()
    if compiler is None:
        return NativeKernel(None, "no C compiler found ($CC, cc, gcc or clang)")
    target = library_file(compiler)
    if target.exists():
        why = f"built with {compiler}, cached at {target}"
    else:
        failed = build([compiler, *FLAGS, str(SOURCE)], target)
        if failed:
            return NativeKernel(None, failed)
        why = f"built with {compiler} into {target}"
    try:
        library = ctypes.CDLL(str(target))
    except OSError as error:
        return NativeKernel(None, f"cannot load {target} ({error})")
    if not library.pp_supported():
        return NativeKernel(None, "this CPU has no AVX-512 VNNI")
    kernel = NativeInt8(library)
    if not answers_right(kernel):
        return NativeKernel(None, f"{target} answers a test product wrongly")
    bf16 = NativeBF16(library)
    if not bf16_answers_right(bf16):
        bf16 = None
    return NativeKernel(library, why, kernel, bf16)


def op_command(compiler: str) -> list[str]:
    """The C++ compiler's command for rows_op.cpp against this torch (its headers, its
    libraries and its C++ ABI), less the output."""
    root = Path(torch.__file__).parent
    headers = root / "include"
    return [compiler, "-O2", "-std=c++20", "-shared", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{headers}", f"-I{headers / 'torch' / 'csrc' / 'api' / 'include'}",
            str(OP_SOURCE), f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu"]


# rows_op.cpp's library once loaded: torch keeps its operators for the life of the process,
# so it is loaded once and bound again to whichever kernel library native_int8 loaded.
_OPS_LIBRARY: ctypes.CDLL | None = None


@cache
def direct_ops(compiler: str) -> str | None:
    """rows_op.cpp's operators (personaplex::int8_rows, personaplex::bf16_rows), built with
    the C++ compiler `compiler` the first time (about 10 s) and cached per source, command
    and torch version, loaded and bound to the kernel's library; core/quantize.py's compiled
    steps call them from then on -> None, or why they are not there (the Python operators
    serve instead)."""
    global _OPS_LIBRARY
    kernel = native_int8()
    if kernel.library is None:
        return kernel.why
    if _OPS_LIBRARY is None:
        command = op_command(compiler)
        target = built_file("rows_op", OP_SOURCE, [*command, torch.__version__])
        if not target.exists():
            failed = build(command, target)
            if failed:
                return failed
        try:
            torch.ops.load_library(str(target))
            _OPS_LIBRARY = ctypes.CDLL(str(target))
        except (OSError, RuntimeError) as error:
            said = str(error).splitlines()
            return f"cannot load {target} ({said[0] if said else type(error).__name__})"
        _OPS_LIBRARY.pp_op_bind.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    _OPS_LIBRARY.pp_op_bind(ctypes.cast(kernel.library.pp_int8_rows, ctypes.c_void_p),
                            ctypes.cast(kernel.library.pp_bf16_rows, ctypes.c_void_p))
    same = ops_answer_as_the_kernel(kernel)
    quantize.use_direct_ops(same)
    return None if same else "the C++ operators answer a test product unlike the kernel"


def ops_answer_as_the_kernel(kernel: NativeKernel) -> bool:
    """A small product through each C++ operator against the kernel through ctypes: the
    same bits (the same function, called another way)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (37, 200), dtype=torch.int8, generator=generator)
    scale = torch.rand(37, generator=generator) / 100
    buffers = kernel.kernel.pack(weight, scale)
    same = True
    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(3, 200, generator=generator).to(dtype)
        same &= torch.equal(torch.ops.personaplex.int8_rows(rows, *buffers),
                            kernel.kernel(rows, *buffers))
    if kernel.bf16 is not None:
        rows = torch.randn(3, 200, generator=generator).bfloat16()
        tiles = kernel.bf16.pack(torch.randn(37, 200, generator=generator).bfloat16())
        same &= torch.equal(torch.ops.personaplex.bf16_rows(rows, tiles, torch.empty(37)),
                            kernel.bf16.bind(tiles, 37)(rows))
    return same


def takes_rows_kernel(device: torch.device, mode: str) -> bool:
    """Whether an LM quantized by `mode` on `device` multiplies int8 activation rows, by the
    kernel built here or by fbgemm's."""
    return mode == "int8" and device.type == "cpu"


def native_kernel_for(device: torch.device, mode: str) -> NativeInt8 | None:
    """The kernel an LM quantized by `mode` takes on `device`, or None."""
    return native_int8().kernel if takes_rows_kernel(device, mode) else None


def native_bf16_for(device: torch.device, mode: str, dtype: torch.dtype) -> NativeBF16 | None:
    """The bf16 product a quantized LM's bf16 linears take on `device`, or None: where the
    int8 kernel is built here (int8 and int4 alike; F.linear's rounding was left behind with
    the quantization)."""
    if mode == "none" or device.type != "cpu" or dtype != torch.bfloat16:
        return None
    return native_int8().bf16


def use_native_int8(device: torch.device, mode: str) -> None:
    """Before an LM's layers are prepared on `device`: hands core/quantize.py the kernel
    where int8 runs it."""
    quantize.use_native_int8(native_kernel_for(device, mode))


def native_line(device: torch.device, mode: str, dtype: torch.dtype) -> str | None:
    """What -v says of the kernels built here that a run takes, or None where it runs no
    int8 and no bf16 linear of a quantized model."""
    tiles = native_bf16_for(device, mode, dtype)
    if not takes_rows_kernel(device, mode):
        if tiles is None:
            return None
        return f"bf16 linears' kernel: personaplex's, AVX-512 ({native_int8().why})"
    kernel = native_int8()
    if kernel.library is None:
        fallback = "fbgemm's" if quantize.fbgemm_present() else "torch's weight-only one"
        return f"int8 kernel: {fallback} ({kernel.why})"
    also = "; the bf16 linears' too" if tiles else ""
    return f"int8 kernel: personaplex's, AVX-512 VNNI{also} ({kernel.why})"
