// rows.c's two products as torch operators written in C++, for the compiled step (--compile):
// personaplex::int8_rows and personaplex::bf16_rows take the arguments of core/quantize.py's
// native_int8 and native_bf16 and give the same bits, but torch's dispatcher calls them with
// no Python in between. A compiled depformer frame makes 200 such calls, and each one through
// Python (the op's Python kernel, then ctypes) cost 15 to 35 us with the caches just swept
// by the weights' streaming: 3 ms a frame (bench/depformer.py).
//
// Built by model/native.py with the C++ compiler inductor uses, against this torch's headers,
// only where a run compiles; it finds rows.c's functions through pp_op_bind (the library
// native.py already loaded), so the two build and load apart.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <new>

extern "C" {
typedef int (*Int8Rows)(const void* x, int x_bf16, int m, int k, int padded_k,
                        const void* packed, const void* row_sums, const void* weight_scale,
                        int n, void* out, int out_bf16, int threads);
typedef int (*Bf16Rows)(const void* x, int m, int k, const void* packed, int n, void* out,
                        int out_bf16, int threads);
}

namespace {

Int8Rows int8_rows_kernel = nullptr;
Bf16Rows bf16_rows_kernel = nullptr;

at::Tensor rows_of(const at::Tensor& rows, const char* op) {
  TORCH_CHECK(rows.dim() == 2, op, ": rows must be [M, K], not ", rows.dim(), "-D");
  return rows.contiguous();
}

// rows [M, K] fp32 or bf16 -> [M, N] in their dtype (quantize.py's native_int8)
at::Tensor int8_rows(const at::Tensor& given, const at::Tensor& blocked,
                     const at::Tensor& row_sums, const at::Tensor& scale) {
  TORCH_CHECK(int8_rows_kernel != nullptr, "int8_rows: rows.c's library is not bound");
  const at::Tensor rows = rows_of(given, "int8_rows");
  const bool bf16 = rows.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || rows.scalar_type() == at::kFloat, "int8_rows: rows must be fp32 or bf16");
  const int64_t m = rows.size(0), k = rows.size(1), n = scale.size(0);
  // blocked [tiles, padded_k / GROUP, TILE_ROWS, GROUP] (model/native.py's to_tiles)
  const int64_t padded_k = blocked.size(1) * blocked.size(3);
  TORCH_CHECK(k <= padded_k, "int8_rows: rows wider than the weight");
  at::Tensor out = at::empty({m, n}, rows.options());
  if (int8_rows_kernel(rows.data_ptr(), bf16, m, k, padded_k, blocked.data_ptr(),
                       row_sums.data_ptr(), scale.data_ptr(), n, out.data_ptr(), bf16,
                       at::get_num_threads()))
    throw std::bad_alloc();
  return out;
}

// rows [M, K] bf16 -> [M, N] bf16, N = width's length (quantize.py's native_bf16)
at::Tensor bf16_rows(const at::Tensor& given, const at::Tensor& tiles, const at::Tensor& width) {
  TORCH_CHECK(bf16_rows_kernel != nullptr, "bf16_rows: rows.c's library is not bound");
  const at::Tensor rows = rows_of(given, "bf16_rows");
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16, "bf16_rows: rows must be bf16");
  const int64_t m = rows.size(0), k = rows.size(1), n = width.size(0);
  at::Tensor out = at::empty({m, n}, rows.options());
  if (bf16_rows_kernel(rows.data_ptr(), m, k, tiles.data_ptr(), n, out.data_ptr(), 1,
                       at::get_num_threads()))
    throw std::bad_alloc();
  return out;
}

// shapes alone, for torch.compile's tracing: sizes as symbols, so that a batch traced as
// "any number of rows" stays so
at::Tensor int8_rows_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&,
                          const at::Tensor& scale) {
  return at::empty_symint({rows.sym_size(0), scale.sym_size(0)}, rows.options());
}

at::Tensor bf16_rows_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor& width) {
  return at::empty_symint({rows.sym_size(0), width.sym_size(0)}, rows.options());
}

}  // namespace

extern "C" void pp_op_bind(void* int8_rows_function, void* bf16_rows_function) {
  int8_rows_kernel = reinterpret_cast<Int8Rows>(int8_rows_function);
  bf16_rows_kernel = reinterpret_cast<Bf16Rows>(bf16_rows_function);
}

TORCH_LIBRARY_FRAGMENT(personaplex, m) {
  m.def("int8_rows(Tensor rows, Tensor blocked, Tensor row_sums, Tensor scale) -> Tensor");
  m.def("bf16_rows(Tensor rows, Tensor tiles, Tensor width) -> Tensor");
}

TORCH_LIBRARY_IMPL(personaplex, CPU, m) {
  m.impl("int8_rows", int8_rows);
  m.impl("bf16_rows", bf16_rows);
}

TORCH_LIBRARY_IMPL(personaplex, Meta, m) {
  m.impl("int8_rows", int8_rows_meta);
  m.impl("bf16_rows", bf16_rows_meta);
}
