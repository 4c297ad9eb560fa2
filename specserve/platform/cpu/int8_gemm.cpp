// A few bf16 rows times an int8 weight with one scale per output column, on CPUs with AVX512-BF16:
// y[M, N] = (x[M, K] @ Q[N, K]^T) * scale[N] (+ bias[N]), fp32 sums, bf16 out.
//
// Q is packed by specserve/platform/cpu/int8_gemm.py as [N / 32][K / 2][2][32]: for each group of 32 output columns,
// K / 2 steps, a step holding the columns' weights at k = 2j (32 bytes), then at k = 2j + 1 (32 bytes); a group is
// one contiguous run. Each 16 weights widen to 16 fp32 (vpmovsxbd, vcvtdq2ps; exact).
//
// A step adds to each of a row's sums (one per column) x[2j + 1] * q[c, 2j + 1], rounded, then x[2j] * q[c, 2j],
// rounded: what one vdpbf16ps does with the pair (q[c, 2j], q[c, 2j + 1]) as bf16 (exact: an int8 has at most 8
// significant bits) against x's pair, whose products are exact in fp32 too. One row takes that as two FMAs per
// column vector (no conversion to bf16); 2 to 4 rows share a step's conversion to bf16 pairs (vcvtne2ps2bf16, and
// vpermw to interleave the two k) and take one vdpbf16ps per row and column vector. Both give the same bits (outside
// fp32 denormals, which vdpbf16ps flushes), so a row's result does not depend on the call's row count: a verify tree
// row equals a one-row decode call. Consecutive steps alternate between two sets of sums (four independent chains
// for a single row), added at the end. A tile of up to 6 rows (24 sums) streams the weights from memory once; more
// rows take tiles of as even sizes as can be (9 rows: 5 and 4), the later ones re-reading the group (K x 32 bytes)
// from the core's L2. Threads split the column groups (OpenMP: the runtime PyTorch itself uses, linked by the
// loader).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "amx.h"
#include "simd.h"

static const int64_t COLS = 32;  // output columns per packed group: 2 vectors of 16 fp32 sums
// Bytes ahead of the two steps being read (two cache lines) that the loop asks the core to fetch, as the bf16
// kernel does (small_gemm.cpp; 0 = none).
#ifndef SPECSERVE_PREFETCH_BYTES
#define SPECSERVE_PREFETCH_BYTES 4096
#endif
static const int64_t PREFETCH_BYTES = SPECSERVE_PREFETCH_BYTES;

static inline void prefetch_two_steps(const int8_t* qs) {  // qs: the first of two consecutive steps (2 x 64 bytes)
    if (PREFETCH_BYTES == 0) return;
    _mm_prefetch((const char*)qs + PREFETCH_BYTES, _MM_HINT_T0);
    _mm_prefetch((const char*)qs + PREFETCH_BYTES + 64, _MM_HINT_T0);
}

static inline __m512 widen(const int8_t* q) {  // 16 int8 -> 16 fp32
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
}

// one row (xf: in fp32): sums[c] += x[2j + 1] * q[., 2j + 1], then += x[2j] * q[., 2j], for column vectors c = 0, 1
static inline void step_one(const float* xf, int64_t j, const int8_t* qs, __m512* sums) {
    const __m512 even = _mm512_set1_ps(xf[2 * j]), odd = _mm512_set1_ps(xf[2 * j + 1]);
    sums[0] = _mm512_fmadd_ps(even, widen(qs), _mm512_fmadd_ps(odd, widen(qs + COLS), sums[0]));
    sums[1] = _mm512_fmadd_ps(even, widen(qs + 16), _mm512_fmadd_ps(odd, widen(qs + COLS + 16), sums[1]));
}

// lanes of vcvtne2ps2bf16(odd, even) (evens in words 0-15, odds in 16-31) -> pairs (even c, odd c) in words 2c, 2c + 1
static inline __m512i pair_index() {
    alignas(64) static const uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_load_si512(idx);
}

// R rows: the step's weights as bf16 pairs, then one vdpbf16ps per row and column vector
template <int R>
static inline void step_rows(const int32_t* const* xr, int64_t j, const int8_t* qs, __m512i index,
                             __m512 (*sums)[2]) {
    __m512bh w[2];
    for (int c = 0; c < 2; c++) {
        __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(widen(qs + COLS + 16 * c), widen(qs + 16 * c));
        w[c] = (__m512bh)_mm512_permutexvar_epi16(index, halves);
    }
    for (int r = 0; r < R; r++) {
        __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][j]);  // x's pair j
        sums[r][0] = _mm512_dpbf16_ps(sums[r][0], a, w[0]);
        sums[r][1] = _mm512_dpbf16_ps(sums[r][1], a, w[1]);
    }
}

// the sums of R rows -> y: (first set + second set) * scale + bias, rounded to nearest even as PyTorch's cast
template <int R>
static inline void store(__m512 (*acc)[R][2], const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    for (int c = 0; c < 2; c++) {
        __m512 s = _mm512_loadu_ps(scale + 16 * c);
        __m512 b = bias ? _mm512_loadu_ps(bias + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            __m512 sum = _mm512_add_ps(acc[0][r][c], acc[1][r][c]);
            _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(sum, s, b)));
        }
    }
}

// R rows (up to 6) of one column group; even steps into the first set of sums, odd steps into the second. xf: a
// single row's x in fp32 (R = 1 only).
template <int R>
static inline void tile(const uint16_t* x, const float* xf, int64_t ldx, int64_t k2, const int8_t* qg,
                        const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    __m512 acc[2][R][2];  // [step parity][row][column vector]
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < R; r++) acc[p][r][0] = acc[p][r][1] = _mm512_setzero_ps();
    int64_t j = 0;
    if (R == 1) {
        for (; j + 1 < k2; j += 2) {
            prefetch_two_steps(qg + j * 2 * COLS);
            step_one(xf, j, qg + j * 2 * COLS, acc[0][0]);
            step_one(xf, j + 1, qg + (j + 1) * 2 * COLS, acc[1][0]);
        }
        if (j < k2) step_one(xf, j, qg + j * 2 * COLS, acc[0][0]);
    } else {
        const int32_t* xr[R];
        for (int r = 0; r < R; r++) xr[r] = (const int32_t*)(x + r * ldx);  // x's pairs as 32-bit words
        const __m512i index = pair_index();
        for (; j + 1 < k2; j += 2) {
            prefetch_two_steps(qg + j * 2 * COLS);
            step_rows<R>(xr, j, qg + j * 2 * COLS, index, acc[0]);
            step_rows<R>(xr, j + 1, qg + (j + 1) * 2 * COLS, index, acc[1]);
        }
        if (j < k2) step_rows<R>(xr, j, qg + j * 2 * COLS, index, acc[0]);
    }
    store<R>(acc, scale, bias, y, ldy);
}

// The most rows of a tile (SPECSERVE_INT8_GEMM_PASS_ROWS: benchmarks/bench_small_gemm_passes.py builds others)
#ifndef SPECSERVE_INT8_GEMM_PASS_ROWS
#define SPECSERVE_INT8_GEMM_PASS_ROWS 6
#endif
static const int64_t PASS_ROWS = SPECSERVE_INT8_GEMM_PASS_ROWS;
static_assert(PASS_ROWS >= 1 && PASS_ROWS <= 6, "a tile holds at most 6 rows' sums");

// xf: the last row's x in fp32 where it makes a tile of its own (the last tile holds one row), else null
static void group_rows(const uint16_t* x, const float* xf, int64_t ldx, int64_t m, int64_t k2, const int8_t* qg,
                       const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < m;) {
        const int64_t rows = pass_rows(m, r0, PASS_ROWS);
        const uint16_t* xs = x + r0 * ldx;
        uint16_t* ys = y + r0 * ldy;
        switch (rows) {
            case 1: tile<1>(xs, xf, ldx, k2, qg, scale, bias, ys, ldy); break;
            case 2: tile<2>(xs, nullptr, ldx, k2, qg, scale, bias, ys, ldy); break;
            case 3: tile<3>(xs, nullptr, ldx, k2, qg, scale, bias, ys, ldy); break;
            case 4: tile<4>(xs, nullptr, ldx, k2, qg, scale, bias, ys, ldy); break;
            case 5: tile<5>(xs, nullptr, ldx, k2, qg, scale, bias, ys, ldy); break;
            default: tile<6>(xs, nullptr, ldx, k2, qg, scale, bias, ys, ldy); break;
        }
        r0 += rows;
    }
}

// ---------------------------------------------------------------- the tile unit
// Where the CPU has AMX, calls of at least `amx_from` rows (0: never) with K a multiple of 32 run on it instead: a
// group's weights are widened to the bf16 pairs above step by step (exact), 16 steps making two weight tiles (16 k
// pairs x 16 columns x 2 bf16, each step's 32 columns one row of each), and one tile instruction multiplies up to 16
// rows of x by each. The widening costs about what the vector loop's one-row pass does, once per call and group
// whatever the row count, where the vector loop pays it once per 4 rows; a lone row stays faster on the vector loop.
// The tile unit adds a pair's two products in its own order, not vdpbf16ps's, so its float32 sums differ from the
// vector loop's in the last bit of a few outputs: a row's bits are the same in any call only when both calls take the
// same path (int8_gemm.py's SPECSERVE_INT8_GEMM_AMX=all sends every call there).

// Tiles: 0 and 1 the sums of a group's two blocks of 16 columns (up to 16 rows x 16 fp32), 2 a block of x (up to 16
// rows x 32 bf16), 3 and 4 the two weight tiles of a block of 16 steps.
//
// Block b (16 steps, k = 32 b .. 32 b + 31) of a group's weights widened into wt: two tiles of 16 rows x 32 bf16 (1 KB
// each), the first for columns 0-15, the second for 16-31
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
static void widen_block(const int8_t* qg, int64_t b, __m512i index, uint16_t* wt) {
    for (int s = 0; s < 16; s++) {
        const int8_t* qs = qg + (16 * b + s) * 2 * COLS;
        for (int c = 0; c < 2; c++) {
            __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(widen(qs + COLS + 16 * c), widen(qs + 16 * c));
            _mm512_store_si512((__m512i*)(wt + c * 512 + s * 32), _mm512_permutexvar_epi16(index, halves));
        }
    }
}

// `rows` rows of x (row stride ldx; the tiles configured for that many) times the group's blocks, widened first into
// wide (blocks x 1024 bf16) where `widened` is false; the first `keep` rows' sums * scale + bias written to y
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
static void amx_rows(const uint16_t* x, int64_t rows, int64_t keep, int64_t ldx, const int8_t* qg, int64_t blocks,
                     bool widened, uint16_t* wide, const float* scale, const float* bias, float* sums, uint16_t* y,
                     int64_t ldy) {
    const __m512i index = pair_index();
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t b = 0; b < blocks; b++) {
        uint16_t* wt = wide + b * 1024;
        if (!widened) {
            if (PREFETCH_BYTES > 0)
                for (int line = 0; line < 16; line++)  // the block's 1 KB
                    _mm_prefetch((const char*)(qg + b * 32 * COLS) + PREFETCH_BYTES + line * 64, _MM_HINT_T0);
            widen_block(qg, b, index, wt);
        }
        _tile_loadd(2, x + b * 32, ldx * 2);
        _tile_loadd(3, wt, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(4, wt + 512, 64);
        _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, sums, COLS * 4);
    _tile_stored(1, sums + 16, COLS * 4);
    for (int c = 0; c < 2; c++) {
        const __m512 s = _mm512_loadu_ps(scale + 16 * c);
        const __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * c) : _mm512_setzero_ps();
        for (int64_t r = 0; r < keep; r++)  // round to nearest even, as PyTorch's float -> bf16 cast
            _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_load_ps(sums + r * COLS + 16 * c),
                                                                            s, bv)));
    }
}

// m rows: up to 16 in one block of rows; more in blocks of 16 over each group's widened weights (the first block
// widens them), the last rows copied into 16 zero-padded ones (`pad`, 16 x k) so that every block keeps the 16-row
// tile configuration (a tile row's sums depend on that row alone)
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
static void amx_gemm(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t groups,
                     const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads,
                     const uint16_t* pad) {
    const int64_t blocks = k / 32, tile_rows = m < 16 ? m : 16, full = m / 16 * 16;
#pragma omp parallel num_threads(threads)
    {
        load_tile_config(tile_rows, 3, 2);
        alignas(64) float sums[16 * COLS];
        static thread_local std::vector<uint16_t> wide_buf;  // the widened weights of a group
        if ((int64_t)wide_buf.size() < blocks * 1024 + 32) wide_buf.resize(blocks * 1024 + 32);
        uint16_t* wide = (uint16_t*)(((uintptr_t)wide_buf.data() + 63) & ~(uintptr_t)63);  // 64-byte aligned
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int8_t* qg = q + g * k * COLS;
            const float* sg = scale + g * COLS;
            const float* bg = bias != nullptr ? bias + g * COLS : nullptr;
            if (m <= 16) {
                amx_rows(x, m, m, ldx, qg, blocks, false, wide, sg, bg, sums, y + g * COLS, ldy);
                continue;
            }
            for (int64_t r0 = 0; r0 < full; r0 += 16)
                amx_rows(x + r0 * ldx, 16, 16, ldx, qg, blocks, r0 > 0, wide, sg, bg, sums, y + r0 * ldy + g * COLS,
                         ldy);
            if (full < m)
                amx_rows(pad, 16, m - full, k, qg, blocks, true, wide, sg, bg, sums, y + full * ldy + g * COLS, ldy);
        }
        _tile_release();
    }
}

// amx_gemm with the zero-padded copy of the last rows it needs past 16 rows -> false (nothing done) where that copy
// cannot be allocated
static bool amx_call(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t groups,
                     const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads) {
    uint16_t* pad;
    if (!padded_tail(x, m, k, ldx, &pad)) return false;
    amx_gemm(x, m, k, ldx, q, groups, scale, bias, y, ldy, threads, pad);
    free(pad);
    return true;
}

// Whether the tile unit runs here (1) or not (0), written to *out.
extern "C" void int8_gemm_amx_ready(int* out) { *out = amx_ready() ? 1 : 0; }

// x: m rows of k bf16 (row stride ldx), k even; q: packed, n a multiple of 32; scale: n floats; bias: n floats or
// null; y: m rows of n bf16 (row stride ldy); amx_from: the fewest rows that take the tile unit where it runs (0:
// never).
extern "C" void int8_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t n,
                               const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads,
                               int64_t amx_from) {
    const int64_t groups = n / COLS, k2 = k / 2;
    if (amx_from > 0 && m >= amx_from && k % 32 == 0 && amx_ready() &&
        amx_call(x, m, k, ldx, q, groups, scale, bias, y, ldy, threads))
        return;
    static thread_local std::vector<float> buf;  // the calling thread's fp32 copy of a lone row, kept between calls
    const float* xf = nullptr;
    if (m > 0 && pass_rows(m, m - 1, PASS_ROWS) == 1) {  // the last row is a tile of its own
        if ((int64_t)buf.size() < k) buf.resize(k);
        const uint16_t* last = x + (m - 1) * ldx;
        for (int64_t j = 0; j < k; j++) {
            uint32_t bits = (uint32_t)last[j] << 16;  // bf16 is fp32's upper half
            memcpy(&buf[j], &bits, 4);
        }
        xf = buf.data();
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        group_rows(x, xf, ldx, m, k2, q + g * k * COLS, scale + g * COLS, bias ? bias + g * COLS : nullptr,
                   y + g * COLS, ldy);
}
