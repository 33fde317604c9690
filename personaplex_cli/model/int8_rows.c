/* int8 x int8 matrix product for the LM's int8 linears on x86 CPUs with AVX-512 VNNI.

   The arithmetic is fbgemm's path in core/quantize.py, to the bit: each activation row x
   is quantized on its own, s = max|x| / 127 (at least 1e-12), a = round-half-even(x / s),
   handed over as a + 128 (uint8); the int32 sum over k of (a + 128) q, less 128 sum(q)
   (`row_sums`), is exact; the output is (float(sum) * weight_scale[n]) * s, rounded to
   bf16 (to nearest even) where the rows are bf16.

   What differs from fbgemm is how the weight is read. A matrix-vector product reads each
   weight byte once and does four multiply-adds with it, so its time is the memory's. The
   weight is stored in blocks of BLOCK_ROWS output rows, their bytes interleaved by 64 (one
   cache line per row in turn), so each thread streams one contiguous stretch of memory
   from start to end, which the hardware prefetchers follow at full rate; the rows of the
   activations (up to ROWS_AT_ONCE of them) are multiplied with each weight line while it
   is in registers.

   Built at run time by model/native.py with the system's C compiler (gcc or clang), into
   personaplex's cache, and called through ctypes. Threads: OpenMP, which torch's own
   runtime serves (the same libgomp), so torch.set_num_threads sets ours too. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK_ROWS 4   /* output rows per block of the packed weight */
#define LINE 64        /* bytes of one row in a block before the next row's */
#define ROWS_AT_ONCE 4 /* activation rows multiplied per pass over a block */
#define STREAMS 4      /* blocks one thread reads side by side for a single row */
#define ZERO_POINT 128
#define INT8_MAX_F 127.0f
#define TINY 1e-12f

int pp_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vnni");
}

int pp_block_rows(void) { return BLOCK_ROWS; }
int pp_line(void) { return LINE; }

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* torch's rounding: to nearest even */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* One row of k floats -> its scale; `out` gets a + 128 for the first k bytes and the zero
   point past them (up to padded_k), where the packed weight is zero. */
static float quantize_row(const float* x, int k, int padded_k, uint8_t* out) {
    __m512 largest = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= k; i += 16)
        largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    float amax = _mm512_reduce_max_ps(largest);
    for (; i < k; i++) {
        float v = x[i] < 0 ? -x[i] : x[i];
        if (v > amax) amax = v;
    }
    float scale = amax / INT8_MAX_F;
    if (!(scale >= TINY)) scale = TINY;
    __m512 s = _mm512_set1_ps(scale), shift = _mm512_set1_ps((float)ZERO_POINT);
    for (i = 0; i + 16 <= k; i += 16) {
        __m512 a = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), s),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i u = _mm512_cvtps_epi32(_mm512_add_ps(a, shift));
        _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtepi32_epi8(u));
    }
    for (; i < k; i++) {
        __m128 a = _mm_round_ss(_mm_setzero_ps(), _mm_set_ss(x[i] / scale),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        out[i] = (uint8_t)((int)_mm_cvtss_f32(a) + ZERO_POINT);
    }
    memset(out + k, ZERO_POINT, (size_t)(padded_k - k));
    return scale;
}

/* The sums of `rows` (1..ROWS_AT_ONCE) activation rows against one block of the weight. */
static inline void block_sums(const uint8_t* a, int rows, int padded_k, const int8_t* block,
                              int32_t sums[ROWS_AT_ONCE][BLOCK_ROWS]) {
    __m512i acc[ROWS_AT_ONCE][BLOCK_ROWS];
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < BLOCK_ROWS; r++) acc[m][r] = _mm512_setzero_si512();
    for (int k = 0; k < padded_k; k += LINE) {
        const int8_t* line = block + (size_t)k * BLOCK_ROWS;
        __m512i w[BLOCK_ROWS];
        for (int r = 0; r < BLOCK_ROWS; r++) w[r] = _mm512_load_si512(line + r * LINE);
        for (int m = 0; m < rows; m++) {
            __m512i x = _mm512_loadu_si512(a + (size_t)m * padded_k + k);
            for (int r = 0; r < BLOCK_ROWS; r++) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], x, w[r]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < BLOCK_ROWS; r++) sums[m][r] = _mm512_reduce_add_epi32(acc[m][r]);
}

/* One activation row against STREAMS blocks at once: memory is read fastest as several
   streams per thread (bench: a thread reading 4 stretches side by side moves 10 to 17% more
   than one reading them in turn). */
static inline void streams_sums(const uint8_t* a, int padded_k, const int8_t* const* blocks,
                                int32_t sums[STREAMS][BLOCK_ROWS]) {
    __m512i acc[STREAMS][BLOCK_ROWS];
    for (int q = 0; q < STREAMS; q++)
        for (int r = 0; r < BLOCK_ROWS; r++) acc[q][r] = _mm512_setzero_si512();
    for (int k = 0; k < padded_k; k += LINE) {
        __m512i x = _mm512_loadu_si512(a + k);
        for (int q = 0; q < STREAMS; q++) {
            const int8_t* line = blocks[q] + (size_t)k * BLOCK_ROWS;
            for (int r = 0; r < BLOCK_ROWS; r++)
                acc[q][r] = _mm512_dpbusd_epi32(acc[q][r], x, _mm512_load_si512(line + r * LINE));
        }
    }
    for (int q = 0; q < STREAMS; q++)
        for (int r = 0; r < BLOCK_ROWS; r++) sums[q][r] = _mm512_reduce_add_epi32(acc[q][r]);
}

static inline const int8_t* block_at(const int8_t* packed, int b, int padded_k) {
    return packed + (size_t)b * BLOCK_ROWS * padded_k;
}

/* Block b's sums for activation row `row` -> its outputs, scaled (and rounded to bf16). */
static inline void store(int b, int row, const int32_t sums[BLOCK_ROWS], const int32_t* row_sums,
                         const float* weight_scale, int n, const float* rows_scale, void* out,
                         int out_bf16) {
    int n0 = b * BLOCK_ROWS, width = n - n0 < BLOCK_ROWS ? n - n0 : BLOCK_ROWS;
    size_t at = (size_t)row * n + n0;
    for (int r = 0; r < width; r++) {
        float y = ((float)(sums[r] - row_sums[n0 + r]) * weight_scale[n0 + r]) * rows_scale[row];
        if (out_bf16) ((uint16_t*)out)[at + r] = float_to_bf16(y);
        else ((float*)out)[at + r] = y;
    }
}

/* Room for this call's quantized rows, their scales and one widened bf16 row: kept per
   thread between calls (a few hundred kB at most), so a call allocates nothing. */
static __thread uint8_t* scratch;
static __thread size_t scratch_size;

static uint8_t* scratch_of(size_t size) {
    if (size > scratch_size) {
        free(scratch);
        scratch = aligned_alloc(64, (size + 63) / 64 * 64);
        scratch_size = scratch ? size : 0;
    }
    return scratch;
}

/* x [m, k] (fp32, or bf16 where x_bf16) times the packed weight of n rows -> out [m, n]
   (bf16 where out_bf16), on `threads` threads (torch's count: OpenMP's own is per calling
   thread) -> 0, or -1 where memory ran out.
   packed: [n_padded / BLOCK_ROWS][padded_k / LINE][BLOCK_ROWS][LINE] int8, 64-byte aligned;
   row_sums [n]: 128 * sum_k q; weight_scale [n] fp32. */
int pp_int8_rows(const void* x, int x_bf16, int m, int k, int padded_k,
                 const int8_t* packed, const int32_t* row_sums, const float* weight_scale,
                 int n, void* out, int out_bf16, int threads) {
    size_t quantized = (size_t)m * padded_k, widened = x_bf16 ? (size_t)k : 0;
    size_t at_scales = (quantized + 63) / 64 * 64;
    size_t at_widened = at_scales + ((size_t)m * sizeof(float) + 63) / 64 * 64;
    uint8_t* room = scratch_of(at_widened + widened * sizeof(float));
    if (!room) return -1;
    float* rows_scale = (float*)(room + at_scales);
    float* row = (float*)(room + at_widened);
    for (int i = 0; i < m; i++) {
        const float* xi = (const float*)x + (size_t)i * k;
        if (x_bf16) {  /* bf16 -> fp32 is exact */
            const uint16_t* h = (const uint16_t*)x + (size_t)i * k;
            for (int j = 0; j < k; j++) row[j] = bf16_to_float(h[j]);
            xi = row;
        }
        rows_scale[i] = quantize_row(xi, k, padded_k, room + (size_t)i * padded_k);
    }
    int blocks = (n + BLOCK_ROWS - 1) / BLOCK_ROWS;
    #pragma omp parallel num_threads(threads)
    {
        /* this thread's stretch of blocks, [first, last) */
        int team = omp_get_num_threads(), id = omp_get_thread_num();
        int first = (int)((long)blocks * id / team), last = (int)((long)blocks * (id + 1) / team);
        int done = first;
        if (m == 1) {  /* STREAMS quarters of the stretch side by side */
            int quarter = (last - first) / STREAMS;
            for (int i = 0; i < quarter; i++) {
                const int8_t* at[STREAMS];
                int32_t sums[STREAMS][BLOCK_ROWS];
                for (int q = 0; q < STREAMS; q++) at[q] = block_at(packed, first + q * quarter + i, padded_k);
                streams_sums(room, padded_k, at, sums);
                for (int q = 0; q < STREAMS; q++)
                    store(first + q * quarter + i, 0, sums[q], row_sums, weight_scale, n,
                          rows_scale, out, out_bf16);
            }
            done = first + STREAMS * quarter;
        }
        for (int b = done; b < last; b++) {
            for (int m0 = 0; m0 < m; m0 += ROWS_AT_ONCE) {
                int rows = m - m0 < ROWS_AT_ONCE ? m - m0 : ROWS_AT_ONCE;
                int32_t sums[ROWS_AT_ONCE][BLOCK_ROWS];
                block_sums(room + (size_t)m0 * padded_k, rows, padded_k,
                           block_at(packed, b, padded_k), sums);
                for (int i = 0; i < rows; i++)
                    store(b, m0 + i, sums[i], row_sums, weight_scale, n, rows_scale, out,
                          out_bf16);
            }
        }
    }
    return 0;
}
