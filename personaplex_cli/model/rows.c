/* Activation rows times weights kept in tiles, for a quantized LM on x86 CPUs with AVX-512:
   int8 x int8 for its int8 linears (VNNI), and bf16 x bf16 for the linears it leaves in
   bf16, its text head and the depformer's input projections and heads (AVX-512F).

   int8. The arithmetic is fbgemm's path in core/quantize.py, to the bit: each activation row x
   is quantized on its own, s = max|x| / 127 (at least 1e-12), a = round-half-even(x / s),
   handed over as a + 128 (uint8); the int32 sum over k of (a + 128) q, less 128 sum(q)
   (`row_sums`), is exact; the output is (float(sum) * weight_scale[n]) * s, rounded to
   bf16 (to nearest even) where the rows are bf16.

   What differs from fbgemm is how the weight is read. At one row a product reads each
   weight byte once, so its time is the memory's. The weight is stored in tiles of
   TILE_ROWS (16) output rows: a tile holds, for each group of GROUP (4) input columns, its
   16 rows' 4 bytes side by side, 64 bytes, one register. One multiply-add instruction
   takes them with 4 bytes of an activation row repeated 16 times, and adds into the tile's
   16 sums; the sums are the outputs, with no adding up across a register at the end. Each
   tile is one contiguous stretch; a thread reads several tiles side by side (memory is
   read fastest as a few streams per thread), and several activation rows are multiplied
   with each weight register while it is loaded.

   bf16. The same tiles, each 32-bit lane holding 2 columns of a row: a row's 2 values,
   broadcast, times 16 rows are added into 16 fp32 sums (bf16_madd). The sums run in fp32
   column by column, so they round differently from torch's F.linear (whose order is
   oneDNN's): for models that left the reference's rounding behind (quantized ones) only.
   An output is its row's own: no row depends on the others in its batch.

   Built at run time by model/native.py with the system's C compiler (gcc or clang), into
   personaplex's cache, and called through ctypes. Threads: OpenMP, which torch's own
   runtime serves (the same libgomp); the count is torch's, passed with each call. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_ROWS 16   /* output rows of a tile: one register of sums */
#define GROUP 4        /* bytes of a row one multiply-add takes per output: 4 int8 columns */
#define ZERO_POINT 128
#define INT8_MAX_F 127.0f
#define TINY 1e-12f
/* Loops over the registers of a pass unrolled whole: the sums then stay in registers (an
   array indexed in a loop left to the compiler went to memory, a load and a store around
   every multiply-add). */
#define UNROLL _Pragma("GCC unroll 16")

int pp_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vnni");
}

int pp_block_rows(void) { return TILE_ROWS; }
int pp_line(void) { return GROUP; }

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
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

/* Where the product goes, and what scales its sums. */
struct outputs {
    const int32_t* row_sums;
    const float* weight_scale;
    const float* rows_scale;
    int n;
    void* out;
    int out_bf16;
};

static inline __mmask16 tile_keeps(const struct outputs* o, int t) {
    int n0 = t * TILE_ROWS, width = o->n - n0 < TILE_ROWS ? o->n - n0 : TILE_ROWS;
    return (__mmask16)((1u << width) - 1);
}

/* Tile t's 16 outputs of row `row`, y -> out, rounded to bf16 as torch rounds (to nearest
   even, NaN 0x7FC0) where out is bf16. */
static inline void store_floats(const struct outputs* o, int t, int row, __m512 y) {
    __mmask16 keep = tile_keeps(o, t);
    size_t at = (size_t)row * o->n + t * TILE_ROWS;
    if (!o->out_bf16) {
        _mm512_mask_storeu_ps((float*)o->out + at, keep, y);
        return;
    }
    __m512i bits = _mm512_castps_si512(y);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16((uint16_t*)o->out + at, keep, _mm512_cvtepi32_epi16(rounded));
}

/* Tile t's 16 int32 sums for row `row` -> its outputs: (sum - row_sums) * weight scale *
   row scale. */
static inline void int8_store(const struct outputs* o, int t, int row, __m512i sums) {
    __mmask16 keep = tile_keeps(o, t);
    __m512i row_sums = _mm512_maskz_loadu_epi32(keep, o->row_sums + t * TILE_ROWS);
    __m512 scale = _mm512_maskz_loadu_ps(keep, o->weight_scale + t * TILE_ROWS);
    store_floats(o, t, row, _mm512_mul_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, row_sums)), scale),
        _mm512_set1_ps(o->rows_scale[row])));
}

/* The two kinds of product, each as a multiply-add of one weight register (16 rows, 4 bytes
   of each) with 4 bytes of an activation row repeated, into one register of 16 sums.
   KIND##_operand(x, a, row_bytes, r, k) names the row's part of it x (x_low and x_high for
   bf16), read at byte k of row r.

   bf16's 4 bytes are 2 columns: each 32-bit lane of the weight is read as two fp32 values,
   the high half kept by masking the low 16 bits off, the low half by shifting it up (exact),
   and multiplied and added in turn, the low column first: two FMAs, where AVX-512 BF16's one
   `vdpbf16ps` would do, as the CPUs measured issue FMAs over three times as fast (a loop of
   either alone, one core: 3.4 to 3.9 against 0.9 to 1.0 billion a second), and any AVX-512
   CPU has them. The compiler splits each weight register once for all the rows it meets. The
   rows come widened to fp32 once a call (pp_bf16_rows), so that each column is one
   broadcast from memory: 2 to 8% faster at 8 rows than splitting each row's lanes at every
   pass, the same at one row. */
static inline __m512 low_halves(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 high_halves(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
#define int8_operand(x, a, row_bytes, r, k)                                                  \
    int32_t x##_four;                                                                        \
    memcpy(&x##_four, (a) + (size_t)(r) * (row_bytes) + (k), 4);                             \
    __m512i x = _mm512_set1_epi32(x##_four);
#define int8_madd(sums, x, w) _mm512_dpbusd_epi32(sums, x, w)
/* a: the rows widened to fp32, row_bytes / 2 floats apart (row_bytes: a bf16 row's) */
#define bf16_operand(x, a, row_bytes, r, k)                                                  \
    const float* x##_at = (const float*)(a) + (size_t)(r) * ((row_bytes) / 2) + (k) / 2;     \
    __m512 x##_low = _mm512_set1_ps(x##_at[0]), x##_high = _mm512_set1_ps(x##_at[1]);
#define bf16_madd(sums, x, w) _mm512_castps_si512(_mm512_fmadd_ps(                           \
    x##_high, high_halves(w),                                                                \
    _mm512_fmadd_ps(x##_low, low_halves(w), _mm512_castsi512_ps(sums))))

/* Tile t's 16 fp32 sums for row `row` of bf16 inputs -> its outputs. */
static inline void bf16_store(const struct outputs* o, int t, int row, __m512i sums) {
    store_floats(o, t, row, _mm512_castsi512_ps(sums));
}

/* ROWS activation rows (from `row`, `row_bytes` apart) times TILES tiles (from `t`, each its
   own stretch of TILE_ROWS * row_bytes) -> their outputs, KIND's product. Every (row, tile)
   pair has its own register of sums, each weight register is loaded once and multiplied
   with every row. One function per shape of pass, its sizes constants: the sums stay in
   registers only where the compiler knows how many there are. */
#define TILES_ROWS(KIND, ROWS, TILES)                                                        \
static void KIND##_##ROWS##_##TILES(const uint8_t* a, size_t row_bytes, const uint8_t* packed, \
                                    int t, int row, const struct outputs* o) {               \
    __m512i acc[ROWS][TILES];                                                                \
    const uint8_t* tile[TILES];                                                              \
    UNROLL for (int j = 0; j < TILES; j++)                                                   \
        tile[j] = packed + (size_t)(t + j) * TILE_ROWS * row_bytes;                          \
    UNROLL for (int i = 0; i < ROWS; i++)                                                    \
        UNROLL for (int j = 0; j < TILES; j++) acc[i][j] = _mm512_setzero_si512();           \
    for (size_t k = 0; k < row_bytes; k += 4) {                                              \
        __m512i w[TILES];                                                                    \
        UNROLL for (int j = 0; j < TILES; j++)                                               \
            w[j] = _mm512_load_si512(tile[j] + k * TILE_ROWS);                               \
        UNROLL for (int i = 0; i < ROWS; i++) {                                              \
            KIND##_operand(x, a, row_bytes, row + i, k)                                      \
            UNROLL for (int j = 0; j < TILES; j++)                                           \
                acc[i][j] = KIND##_madd(acc[i][j], x, w[j]);                                 \
        }                                                                                    \
    }                                                                                        \
    UNROLL for (int i = 0; i < ROWS; i++)                                                    \
        UNROLL for (int j = 0; j < TILES; j++) KIND##_store(o, t + j, row + i, acc[i][j]);   \
}

/* Tiles [first, last) for all m rows: rows in passes of 8 (4, 3, 2 or 1 for what is left),
   tiles side by side as many as the registers hold (32: sums, weights and the row). */
#define TILES_FOR(KIND)                                                                      \
TILES_ROWS(KIND, 8, 2) TILES_ROWS(KIND, 8, 1) TILES_ROWS(KIND, 4, 4) TILES_ROWS(KIND, 4, 1)  \
TILES_ROWS(KIND, 3, 6) TILES_ROWS(KIND, 3, 1) TILES_ROWS(KIND, 2, 6) TILES_ROWS(KIND, 2, 1)  \
TILES_ROWS(KIND, 1, 8) TILES_ROWS(KIND, 1, 1)                                                \
static void KIND##_tiles(const uint8_t* a, int m, size_t row_bytes, const uint8_t* packed,   \
                         int first, int last, const struct outputs* o) {                     \
    int row = 0;                                                                             \
    PASSES(KIND, 8, 2) PASSES(KIND, 4, 4) PASSES(KIND, 3, 6) PASSES(KIND, 2, 6)              \
    PASSES(KIND, 1, 8)                                                                       \
}
/* as many passes of ROWS rows as fit, each over the tiles TILES at a time, then one by one */
#define PASSES(KIND, ROWS, TILES)                                                            \
    for (; row + ROWS <= m; row += ROWS) {                                                   \
        int t = first;                                                                       \
        for (; t + TILES <= last; t += TILES)                                                \
            KIND##_##ROWS##_##TILES(a, row_bytes, packed, t, row, o);                        \
        for (; t < last; t++) KIND##_##ROWS##_1(a, row_bytes, packed, t, row, o);            \
    }

TILES_FOR(int8)
TILES_FOR(bf16)

/* The tiles of `count` split evenly over `threads` threads, KIND's product on each. */
#define SPLIT_TILES(KIND, a, m, row_bytes, packed, count, o, threads)                        \
    _Pragma("omp parallel num_threads(threads)")                                             \
    {                                                                                        \
        int team = omp_get_num_threads(), id = omp_get_thread_num();                         \
        KIND##_tiles(a, m, row_bytes, packed, (int)((long)(count) * id / team),              \
                     (int)((long)(count) * (id + 1) / team), o);                             \
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
   packed: [ceil(n / TILE_ROWS)][padded_k / GROUP][TILE_ROWS][GROUP] int8, 64-byte aligned,
   zero past n rows and k columns (padded_k: k rounded up to GROUP);
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
    float* wide_row = (float*)(room + at_widened);
    for (int i = 0; i < m; i++) {
        const float* xi = (const float*)x + (size_t)i * k;
        if (x_bf16) {  /* bf16 -> fp32 is exact */
            const uint16_t* h = (const uint16_t*)x + (size_t)i * k;
            for (int j = 0; j < k; j++) wide_row[j] = bf16_to_float(h[j]);
            xi = wide_row;
        }
        rows_scale[i] = quantize_row(xi, k, padded_k, room + (size_t)i * padded_k);
    }
    struct outputs o = {row_sums, weight_scale, rows_scale, n, out, out_bf16};
    SPLIT_TILES(int8, room, m, (size_t)padded_k, (const uint8_t*)packed,
                (n + TILE_ROWS - 1) / TILE_ROWS, &o, threads)
    return 0;
}

/* x [m, k] bf16 (k even) times the packed bf16 weight of n rows -> out [m, n] (bf16 where
   out_bf16, else fp32), on `threads` threads -> 0, or -1 where memory ran out (for the rows
   widened to fp32, kept between calls as the int8 product's scratch).
   packed: [ceil(n / TILE_ROWS)][k / 2][TILE_ROWS][2] bf16, 64-byte aligned, zero past n. */
int pp_bf16_rows(const uint16_t* x, int m, int k, const uint16_t* packed, int n, void* out,
                 int out_bf16, int threads) {
    float* wide = (float*)scratch_of((size_t)m * k * sizeof(float));
    if (!wide) return -1;
    for (size_t i = 0; i < (size_t)m * k; i++) wide[i] = bf16_to_float(x[i]);
    struct outputs o = {NULL, NULL, NULL, n, out, out_bf16};
    SPLIT_TILES(bf16, (const uint8_t*)wide, m, (size_t)k * 2, (const uint8_t*)packed,
                (n + TILE_ROWS - 1) / TILE_ROWS, &o, threads)
    return 0;
}
