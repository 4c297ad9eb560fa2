// A few rows times a bf16 weight on CPUs with AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 sums.
//
// W is packed by specserve/platform/cpu/small_gemm.py as [N / 64][K / 2][64][2]: for each group of 64 output
// columns, K / 2 steps of 64 column pairs (w[n, 2j], w[n, 2j + 1]), i.e. 256 contiguous bytes a step. One
// vdpbf16ps multiplies 16 such pairs by a broadcast pair of x and adds both products to 16 fp32 sums, so a step
// takes 4 loads and 4 vdpbf16ps per row. A pass over a group takes up to PASS_ROWS rows (6: 24 accumulators, the
// weights' 4 vectors and the broadcast x in the 32 registers), so the weights stream from memory once for up to that
// many rows; more rows take passes of as even sizes as can be (9 rows: 5 and 4, not 4, 4 and 1), the later ones
// re-reading the group (K x 128 bytes) from the core's L2, where each costs about its rows' vdpbf16ps. A column's sum
// takes the same vdpbf16ps in the same order whatever the pass, so a row's bits do not depend on the rows beside it.
// Threads split the column groups (OpenMP: the runtime PyTorch itself uses, linked by the loader).
//
// Where the CPU has AMX (AMX-TILE and AMX-BF16, e.g. Sapphire Rapids) and Linux grants the process its tile state,
// calls of at least `amx_from` rows (0: none) with K a multiple of 32 run on the tile unit instead (``amx_gemm``):
// one tile instruction multiplies up to 16 rows by 16 columns over 32 k at once, so 16 rows cost about what one
// does (the weights' read), where the vector loop above does up to 6 rows a pass; more rows go 16 at a time over each
// group while it is in the core's cache. Its float32 sums round differently from
// the vector loop's in a few outputs in 10,000, so a row's bits are the same in any call only when both calls take
// the same path (small_gemm.py chooses `amx_from` by timing both at load).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "simd.h"

static const int64_t COLS = 64;  // output columns per packed group: 4 vectors of 16 fp32 sums
// Bytes ahead of the step being read that each step asks the core to fetch (its 4 cache lines, 16 steps ahead; 0 =
// none, the hardware prefetchers alone): with those alone a SmolLM2-sized pass was slower on a 2-core Xeon whose
// memory was shared with a neighbour, and faster on a 2-core AMD EPYC (docs/benchmarks.md), so small_gemm.py's probe
// sets it at load (``small_gemm_set_prefetch``); SPECSERVE_PREFETCH_BYTES is the distance until then (benchmarks
// build others). A prefetch past the weights' end does not fault.
#ifndef SPECSERVE_PREFETCH_BYTES
#define SPECSERVE_PREFETCH_BYTES 4096
#endif
static int64_t prefetch_bytes = SPECSERVE_PREFETCH_BYTES;

// The prefetch distance of later calls (bytes >= 0; 0: none).
extern "C" void small_gemm_set_prefetch(int64_t bytes) { prefetch_bytes = bytes > 0 ? bytes : 0; }
extern "C" int64_t small_gemm_prefetch() { return prefetch_bytes; }

template <int R>
static inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* wg, int64_t k2, const float* bias,
                        uint16_t* y, int64_t ldy, int64_t prefetch) {
    __m512 acc[R][4];
    for (int c = 0; c < 4; c++) {
        __m512 b = bias ? _mm512_loadu_ps(bias + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) acc[r][c] = b;
    }
    const int32_t* xr[R];
    for (int r = 0; r < R; r++) xr[r] = (const int32_t*)(x + r * ldx);  // x's pairs as 32-bit words
    for (int64_t j = 0; j < k2; j++) {
        const __m512i* w = (const __m512i*)(wg + j * 2 * COLS);
        if (prefetch > 0)
            for (int line = 0; line < 4; line++) _mm_prefetch((const char*)(w + line) + prefetch, _MM_HINT_T0);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 1);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2), w3 = (__m512bh)_mm512_loadu_si512(w + 3);
        for (int r = 0; r < R; r++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][j]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++)  // round to nearest even, as PyTorch's float -> bf16 cast
            _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

// The most rows of a pass (SPECSERVE_SMALL_GEMM_PASS_ROWS: benchmarks/bench_small_gemm_passes.py builds others)
#ifndef SPECSERVE_SMALL_GEMM_PASS_ROWS
#define SPECSERVE_SMALL_GEMM_PASS_ROWS 6
#endif
static const int64_t PASS_ROWS = SPECSERVE_SMALL_GEMM_PASS_ROWS;
static_assert(PASS_ROWS >= 1 && PASS_ROWS <= 6, "a pass holds at most 6 rows' accumulators");

static void group_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* wg, int64_t k2, const float* bias,
                       uint16_t* y, int64_t ldy, int64_t prefetch) {
    for (int64_t r0 = 0; r0 < m;) {
        const int64_t rows = pass_rows(m, r0, PASS_ROWS);
        const uint16_t* xs = x + r0 * ldx;
        uint16_t* ys = y + r0 * ldy;
        switch (rows) {
            case 1: tile<1>(xs, ldx, wg, k2, bias, ys, ldy, prefetch); break;
            case 2: tile<2>(xs, ldx, wg, k2, bias, ys, ldy, prefetch); break;
            case 3: tile<3>(xs, ldx, wg, k2, bias, ys, ldy, prefetch); break;
            case 4: tile<4>(xs, ldx, wg, k2, bias, ys, ldy, prefetch); break;
            case 5: tile<5>(xs, ldx, wg, k2, bias, ys, ldy, prefetch); break;
            default: tile<6>(xs, ldx, wg, k2, bias, ys, ldy, prefetch); break;
        }
        r0 += rows;
    }
}

// Tiles: 0-3 the sums of a group's 4 blocks of 16 columns (up to 16 rows x 16 fp32), 4 a block of x (up to 16 rows x
// 32 bf16), 5 and 6 a block of weights in turn (16 k pairs x 16 columns x 2 bf16). In the packed layout a group's 16
// steps from step j on are 4 KB in a row, and the 16 columns from c on are 64 bytes at c * 4 bytes into each
// 256-byte step: a weight tile is read straight from it with a 256-byte stride.
//
// One group's 64 columns for `rows` rows of x (row stride ldx; the tiles configured for that many rows), the first
// `keep` of them written to y.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
static void amx_group(const uint16_t* x, int64_t rows, int64_t keep, int64_t ldx, const uint16_t* wg, int64_t blocks,
                      const float* bias, float* sums, uint16_t* y, int64_t ldy, int64_t prefetch) {
    if (bias != nullptr) {  // the sums start from the bias, as the vector loop's do
        for (int64_t r = 0; r < rows; r++) memcpy(sums + r * COLS, bias, COLS * sizeof(float));
        _tile_loadd(0, sums, COLS * 4);
        _tile_loadd(1, sums + 16, COLS * 4);
        _tile_loadd(2, sums + 32, COLS * 4);
        _tile_loadd(3, sums + 48, COLS * 4);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t* wb = wg + b * 16 * 2 * COLS;  // 16 steps of 128 bf16
        if (prefetch > 0)
            for (int line = 0; line < 64; line++) _mm_prefetch((const char*)wb + prefetch + line * 64, _MM_HINT_T0);
        _tile_loadd(4, x + b * 32, ldx * 2);
        _tile_loadd(5, wb, 2 * COLS * 2);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, wb + 32, 2 * COLS * 2);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, wb + 64, 2 * COLS * 2);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, wb + 96, 2 * COLS * 2);
        _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, sums, COLS * 4);
    _tile_stored(1, sums + 16, COLS * 4);
    _tile_stored(2, sums + 32, COLS * 4);
    _tile_stored(3, sums + 48, COLS * 4);
    for (int64_t r = 0; r < keep; r++)
        for (int c = 0; c < 4; c++)  // round to nearest even, as PyTorch's float -> bf16 cast
            _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + r * COLS + 16 * c)));
}

// m rows: up to 16 in one block; more in blocks of 16 over each group while its weights are in the core's cache, the
// last rows copied into 16 zero-padded ones (`pad`, 16 x k) so that every block keeps the 16-row tile configuration
// (a tile row's sums depend on that row alone: the padding changes no other row's bits).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
static void amx_gemm(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t groups,
                     const float* bias, uint16_t* y, int64_t ldy, int threads, const uint16_t* pad) {
    const int64_t blocks = k / 32, tile_rows = m < 16 ? m : 16, full = m / 16 * 16, prefetch = prefetch_bytes;
#pragma omp parallel num_threads(threads)
    {
        load_tile_config(tile_rows, 5, 2);
        alignas(64) float sums[16 * COLS];  // a block's rows of a group's 64 sums
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t* wg = w + g * k * COLS;
            const float* bg = bias != nullptr ? bias + g * COLS : nullptr;
            if (m <= 16) {
                amx_group(x, m, m, ldx, wg, blocks, bg, sums, y + g * COLS, ldy, prefetch);
                continue;
            }
            for (int64_t r0 = 0; r0 < full; r0 += 16)
                amx_group(x + r0 * ldx, 16, 16, ldx, wg, blocks, bg, sums, y + r0 * ldy + g * COLS, ldy,
                          prefetch);
            if (full < m)  // the padding rows' sums are computed and dropped
                amx_group(pad, 16, m - full, k, wg, blocks, bg, sums, y + full * ldy + g * COLS, ldy, prefetch);
        }
        _tile_release();
    }
}

// amx_gemm with the zero-padded copy of the last rows it needs past 16 rows -> false (nothing done) where that copy
// cannot be allocated.
static bool amx_call(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t groups,
                     const float* bias, uint16_t* y, int64_t ldy, int threads) {
    uint16_t* pad;
    if (!padded_tail(x, m, k, ldx, &pad)) return false;
    amx_gemm(x, m, k, ldx, w, groups, bias, y, ldy, threads, pad);
    free(pad);
    return true;
}

// Whether the tile unit runs here (1) or not (0), written to *out.
extern "C" void small_gemm_amx_ready(int* out) { *out = amx_ready() ? 1 : 0; }

// x: m rows of k bf16 (row stride ldx); w: packed, n a multiple of 64, k even; bias: n floats or null;
// y: m rows of n bf16 (row stride ldy); amx_from: the fewest rows that take the tile unit where it runs (0: never).
extern "C" void small_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                                const float* bias, uint16_t* y, int64_t ldy, int threads, int64_t amx_from) {
    const int64_t groups = n / COLS, k2 = k / 2, prefetch = prefetch_bytes;
    if (amx_from > 0 && m >= amx_from && k % 32 == 0 && amx_ready() &&
        amx_call(x, m, k, ldx, w, groups, bias, y, ldy, threads))
        return;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        group_rows(x, ldx, m, w + g * k * COLS, k2, bias ? bias + g * COLS : nullptr, y + g * COLS, ldy, prefetch);
}
