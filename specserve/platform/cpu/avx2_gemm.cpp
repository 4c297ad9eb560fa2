// Any number of rows times a bf16 weight on CPUs with AVX2 and FMA but no AVX512 (e.g. an AMD EPYC of the Zen 3
// generation), where oneDNN packs no bf16 weight and PyTorch's bf16 matmul reads the weight once per row:
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 sums, rounded to bf16.
//
// W is in small_gemm.cpp's layout, [N / 64][K / 2][64][2]: for each group of 64 output columns, K / 2 steps of 64
// column pairs (w[n, 2j], w[n, 2j + 1]). A 256-bit load holds 8 such pairs; shifting each 32-bit lane left by 16
// gives the 8 columns' weights at k = 2j as floats, masking off the low half gives those at 2j + 1. Each output's sum
// starts from the bias and adds w[n, k] * x[m, k] for k = 0, 1, 2, ... with one FMA each, in that order, whatever
// the call's row count and whichever tile computes it: a row's result has the same bits in a one-row decode, a
// verify tree or a prefill.
//
// One row streams each group's weights once, 64 columns at a time (8 accumulators). More rows go 4 at a time over
// 16 columns (8 accumulators, the 4 weight vectors of a step shared by the 4 rows), the group's weights then re-read
// from the core's caches; rows come in blocks of ROW_BLOCK so that a block's inputs (converted to float32 once per
// call) stay in the core's L2 while the column blocks pass over them. Threads split the column blocks (OpenMP: the
// runtime PyTorch itself uses, linked by the loader).
//
// The same file holds the AVX2 kernel for int8 weights (``avx2_int8_gemm_bf16``, below; int8_gemm.py calls it).
#include <omp.h>
#include <stdlib.h>

#include "simd_avx2.h"

static const int64_t COLS = 64;       // output columns per packed group
static const int64_t ROW_BLOCK = 64;  // rows whose float32 inputs stay in L2 while the column blocks pass over them

static inline __m256 low_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }  // k = 2j
static inline __m256 high_half(__m256i v) {                                                        // k = 2j + 1
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

// 16 floats (a, b: columns 0-7, 8-15) -> 16 bf16 at y
static inline void store16(uint16_t* y, __m256 a, __m256 b) {
    // packus interleaves the 128-bit lanes (a0-3 b0-3 a4-7 b4-7); the permute puts them back in order
    const __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));
    _mm256_storeu_si256((__m256i*)y, _mm256_permute4x64_epi64(packed, 0xD8));
}

// bf16 -> float32, n values
static inline void row_to_floats(const uint16_t* x, int64_t n, float* xf) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;  // bf16 is float32's upper half
        __builtin_memcpy(xf + i, &bits, sizeof(float));
    }
}

// x: m rows of k bf16 (row stride ldx) -> xf: m rows of k floats (row stride k). Inside a parallel region: the
// threads share the rows, and the implicit barrier at its end lets every thread read all of xf after it.
static void to_floats(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, float* xf) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) row_to_floats(x + r * ldx, k, xf + r * k);
}

// x (m rows of k bf16, row stride ldx) as float32 rows (row stride k) in a buffer of this call, then one_row(xf) where
// m == 1, else rows(xf), run by every thread of one parallel region (their loops split the work with omp for) ->
// 0, or -1 where the buffer could not be allocated (nothing run). A lone row is converted by every thread into its
// own part of the buffer, so that no thread waits on another before its share of the columns.
template <typename OneRow, typename Rows>
static int on_float_rows(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, int threads, OneRow one_row, Rows rows) {
    const int64_t copies = m == 1 ? threads : m;
    float* xf = (float*)malloc((size_t)(copies * k) * sizeof(float));
    if (xf == nullptr) return -1;
#pragma omp parallel num_threads(threads)
    {
        if (m == 1) {
            float* mine = xf + omp_get_thread_num() * k;
            row_to_floats(x, k, mine);
            one_row(mine);
        } else {
            to_floats(x, m, k, ldx, xf);
            rows(xf);
        }
    }
    free(xf);
    return 0;
}

#ifndef SPECSERVE_PREFETCH_BYTES
#define SPECSERVE_PREFETCH_BYTES 1024
#endif
// how far ahead a lone row asks for the weights (0: not at all): a pass over SmolLM2's bf16 linears at one row took
// 10.75-10.84 ms against 11.18-11.43 ms without (median of 11 alternating passes, two runs); 512 bytes did as well,
// 2048 no better than none, 4096 worse
static const int64_t PREFETCH_BYTES = SPECSERVE_PREFETCH_BYTES;

// Ask for the 4 cache lines of one step of a group (2 * COLS bf16) starting at p.
static inline void prefetch_step(const void* p) {
    for (int l = 0; l < 4; l++) _mm_prefetch((const char*)p + 64 * l, _MM_HINT_T0);
}

// One row (x: k2 pairs as floats) times one group's 64 columns.
static void row_group(const float* x, const uint16_t* wg, int64_t k2, const float* bias, uint16_t* y) {
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = bias ? _mm256_loadu_ps(bias + 8 * c) : _mm256_setzero_ps();
    for (int64_t j = 0; j < k2; j++) {
        const __m256i* w = (const __m256i*)(wg + j * 2 * COLS);
        if (PREFETCH_BYTES) prefetch_step((const char*)w + PREFETCH_BYTES);
        const __m256 xe = _mm256_broadcast_ss(x + 2 * j), xo = _mm256_broadcast_ss(x + 2 * j + 1);
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256(w + c);
            acc[c] = _mm256_fmadd_ps(low_half(v), xe, acc[c]);
            acc[c] = _mm256_fmadd_ps(high_half(v), xo, acc[c]);
        }
    }
    for (int c = 0; c < 8; c += 2) store16(y + 8 * c, acc[c], acc[c + 1]);
}

#ifndef SPECSERVE_ROWS_PREFETCH_STEPS
#define SPECSERVE_ROWS_PREFETCH_STEPS 2
#endif
// how many steps ahead (of 2 * COLS bf16, 4 cache lines) a group's first block asks for the group's weights in calls
// of several rows (0: not at all). A pass over SmolLM2's bf16 linears and LM head at 4 / 8 / 16 rows took 16.9-17.2 /
// 22.3-22.6 / 33.4-33.7 ms against 20.5-22.1 / 27.4-28.9 / 39.2-41.2 ms without (median ms of bench_int8.py, two runs
// each, builds alternating); 4 and 8 steps did no better than 2, and asking for the next group's weights as well
// (into L1 or L2) did no better than none
static const int64_t ROWS_PREFETCH_STEPS = SPECSERVE_ROWS_PREFETCH_STEPS;

// R rows (x: row stride ldx floats) times 16 columns: the block at column offset 16 * b of a group (wb = its first
// pair; steps 2 * COLS bf16 apart). prefetch: whether to ask for the whole group's weights ROWS_PREFETCH_STEPS steps
// ahead (wb is then the group's first block): the group's other blocks, which read the same steps' other cache
// lines, find them in cache.
template <int R>
static void rows_block(const float* x, int64_t ldx, const uint16_t* wb, int64_t k2, const float* bias, uint16_t* y,
                       int64_t ldy, bool prefetch) {
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        acc[r][1] = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < k2; j++) {
        const __m256i* w = (const __m256i*)(wb + j * 2 * COLS);
        if (ROWS_PREFETCH_STEPS && prefetch) prefetch_step(wb + (j + ROWS_PREFETCH_STEPS) * 2 * COLS);
        const __m256i v0 = _mm256_loadu_si256(w), v1 = _mm256_loadu_si256(w + 1);
        const __m256 e0 = low_half(v0), o0 = high_half(v0), e1 = low_half(v1), o1 = high_half(v1);
        for (int r = 0; r < R; r++) {
            const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * j), xo = _mm256_broadcast_ss(x + r * ldx + 2 * j + 1);
            acc[r][0] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, acc[r][0]));
            acc[r][1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, acc[r][1]));
        }
    }
    for (int r = 0; r < R; r++) store16(y + r * ldy, acc[r][0], acc[r][1]);
}

// prefetch: see rows_block; asked of the first row tile only (the later ones find the block in cache)
static void block_rows(const float* x, int64_t ldx, int64_t m, const uint16_t* wb, int64_t k2, const float* bias,
                       uint16_t* y, int64_t ldy, bool prefetch) {
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const float* xs = x + r0 * ldx;
        uint16_t* ys = y + r0 * ldy;
        const bool pf = prefetch && r0 == 0;
        switch (m - r0 < 4 ? m - r0 : 4) {
            case 1: rows_block<1>(xs, ldx, wb, k2, bias, ys, ldy, pf); break;
            case 2: rows_block<2>(xs, ldx, wb, k2, bias, ys, ldy, pf); break;
            case 3: rows_block<3>(xs, ldx, wb, k2, bias, ys, ldy, pf); break;
            default: rows_block<4>(xs, ldx, wb, k2, bias, ys, ldy, pf); break;
        }
    }
}

// x: m rows of k bf16 (row stride ldx); w: packed (small_gemm.cpp's layout), n a multiple of 64, k even; bias: n
// floats or null; y: m rows of n bf16 (row stride ldy). Returns 0, or -1 where the float32 copy of x could not be
// allocated (nothing written).
extern "C" int avx2_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                              const float* bias, uint16_t* y, int64_t ldy, int threads) {
    const int64_t groups = n / COLS, k2 = k / 2, blocks = n / 16;
    auto one_row = [&](const float* xf) {
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++)
            row_group(xf, w + g * k * COLS, k2, bias ? bias + g * COLS : nullptr, y + g * COLS);
    };
    auto rows = [&](const float* xf) {
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int64_t count = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t g = b / 4, c = b % 4;
                block_rows(xf + r0 * k, k, count, w + g * k * COLS + 32 * c, k2, bias ? bias + 16 * b : nullptr,
                           y + r0 * ldy + 16 * b, ldy, c == 0);
            }
        }
    };
    return on_float_rows(x, m, k, ldx, threads, one_row, rows);
}

// ---------------------------------------------------------------------------------------------- int8 weights
// y[M, N] = (x[M, K] @ Q[N, K]^T) * scale[N] (+ bias[N]) for an int8 weight with one scale per output column, in
// int8_gemm.cpp's layout [N / 32][K / 2][2][32]: per group of 32 output columns, K / 2 steps holding the columns'
// weights at k = 2j (32 bytes), then at k = 2j + 1. 8 weights widen to 8 floats (vpmovsxbd, vcvtdq2ps; exact).
// Each output's sum starts from 0 and adds q[n, k] * x[m, k] for k = 0, 1, 2, ..., whatever the call's row count;
// then one FMA applies the scale and the bias, and the result rounds to bf16. An int8 times a bf16 is exact in
// float32, so an FMA onto the sum and a multiply followed by an add round alike: a row's result has the same bits in
// any call.
//
// One row streams each group once, two groups side by side (8 sums, two chained FMAs a step each: a thread's last
// group, where its share is odd, goes alone with 4 sums, its products computed apart from them, since FMAs chained
// on 4 sums wait on each other's latency). An FMA is one instruction where a product and its add are two, beside the
// two a widening takes: with two groups at a time a one-row pass over SmolLM2's int8 linears and LM head took 6.6-6.9
// ms against 7.7-8.3 a group at a time (fastest of 11 alternating passes, two runs; benchmarks/bench_int8.py).
// More rows go 4 at a time over half a group (16 columns; 8 sums, a step's 4 widened weight vectors shared by the 4
// rows; FMAs), the group's bytes then re-read from the core's L1 (K x 32 bytes). Threads split the groups (a one-row
// call: each thread a contiguous share, as schedule(static)), or the half groups.
static const int64_t Q_COLS = 32;  // output columns per packed int8 group
#ifndef SPECSERVE_Q_PREFETCH_BYTES
#define SPECSERVE_Q_PREFETCH_BYTES 4096
#endif
// how far ahead a lone row asks for the weights (0: the line it reads): a pass over SmolLM2's int8 linears at one row
// took 4.75 ms against 5.46 without it (0), median of 11 alternating passes
static const int64_t Q_PREFETCH_BYTES = SPECSERVE_Q_PREFETCH_BYTES;

static inline __m256 widen8(const int8_t* q) {  // 8 int8 -> 8 floats
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q)));
}

// 16 sums (columns 0-7, 8-15) -> times scale, plus bias (16 floats each, bias possibly null) -> 16 bf16 at y
static inline void store16_scaled(uint16_t* y, __m256 a, __m256 b, const float* scale, const float* bias) {
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    store16(y, _mm256_fmadd_ps(a, _mm256_loadu_ps(scale), b0), _mm256_fmadd_ps(b, _mm256_loadu_ps(scale + 8), b1));
}

// One row (x as floats) times one group's 32 columns.
static void q_row_group(const float* x, const int8_t* qg, int64_t k2, const float* scale, const float* bias,
                        uint16_t* y) {
    __m256 acc[4];
    for (int c = 0; c < 4; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k2; j++) {
        const int8_t* s = qg + j * 2 * Q_COLS;
        _mm_prefetch((const char*)s + Q_PREFETCH_BYTES, _MM_HINT_T0);
        const __m256 xe = _mm256_broadcast_ss(x + 2 * j), xo = _mm256_broadcast_ss(x + 2 * j + 1);
        __m256 e[4], o[4];  // the products (exact), computed off the sums' dependency chains
        for (int c = 0; c < 4; c++) e[c] = _mm256_mul_ps(widen8(s + 8 * c), xe);
        for (int c = 0; c < 4; c++) o[c] = _mm256_mul_ps(widen8(s + Q_COLS + 8 * c), xo);
        for (int c = 0; c < 4; c++) acc[c] = _mm256_add_ps(_mm256_add_ps(acc[c], e[c]), o[c]);
    }
    store16_scaled(y, acc[0], acc[1], scale, bias);
    store16_scaled(y + 16, acc[2], acc[3], scale + 16, bias ? bias + 16 : nullptr);
}

// One row (x as floats) times two consecutive groups' 64 columns (qg: the first group; scale, bias, y: its first
// column's)
static void q_row_two_groups(const float* x, const int8_t* qg, int64_t k2, const float* scale, const float* bias,
                             uint16_t* y) {
    const int8_t* qg2 = qg + k2 * 2 * Q_COLS;
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k2; j++) {
        const int8_t* s = qg + j * 2 * Q_COLS;
        const int8_t* s2 = qg2 + j * 2 * Q_COLS;
        _mm_prefetch((const char*)s + Q_PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char*)s2 + Q_PREFETCH_BYTES, _MM_HINT_T0);
        const __m256 xe = _mm256_broadcast_ss(x + 2 * j), xo = _mm256_broadcast_ss(x + 2 * j + 1);
        for (int c = 0; c < 4; c++) {
            acc[c] = _mm256_fmadd_ps(widen8(s + Q_COLS + 8 * c), xo, _mm256_fmadd_ps(widen8(s + 8 * c), xe, acc[c]));
            acc[4 + c] = _mm256_fmadd_ps(widen8(s2 + Q_COLS + 8 * c), xo,
                                         _mm256_fmadd_ps(widen8(s2 + 8 * c), xe, acc[4 + c]));
        }
    }
    for (int h = 0; h < 4; h++)
        store16_scaled(y + 16 * h, acc[2 * h], acc[2 * h + 1], scale + 16 * h, bias ? bias + 16 * h : nullptr);
}

// R rows (x: row stride ldx floats) times 16 columns: half h of a group (qh = the group's first step + 16 h).
template <int R>
static void q_rows_half(const float* x, int64_t ldx, const int8_t* qh, int64_t k2, const float* scale,
                        const float* bias, uint16_t* y, int64_t ldy) {
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k2; j++) {
        const int8_t* s = qh + j * 2 * Q_COLS;
        const __m256 e0 = widen8(s), e1 = widen8(s + 8), o0 = widen8(s + Q_COLS), o1 = widen8(s + Q_COLS + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * j), xo = _mm256_broadcast_ss(x + r * ldx + 2 * j + 1);
            acc[r][0] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, acc[r][0]));
            acc[r][1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, acc[r][1]));
        }
    }
    for (int r = 0; r < R; r++) store16_scaled(y + r * ldy, acc[r][0], acc[r][1], scale, bias);
}

static void q_half_rows(const float* x, int64_t ldx, int64_t m, const int8_t* qh, int64_t k2, const float* scale,
                        const float* bias, uint16_t* y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const float* xs = x + r0 * ldx;
        uint16_t* ys = y + r0 * ldy;
        switch (m - r0 < 4 ? m - r0 : 4) {
            case 1: q_rows_half<1>(xs, ldx, qh, k2, scale, bias, ys, ldy); break;
            case 2: q_rows_half<2>(xs, ldx, qh, k2, scale, bias, ys, ldy); break;
            case 3: q_rows_half<3>(xs, ldx, qh, k2, scale, bias, ys, ldy); break;
            default: q_rows_half<4>(xs, ldx, qh, k2, scale, bias, ys, ldy); break;
        }
    }
}

// x: m rows of k bf16 (row stride ldx), k even; q: packed, n a multiple of 32; scale: n floats; bias: n floats or
// null; y: m rows of n bf16 (row stride ldy). Returns 0, or -1 where the float32 copy of x could not be allocated.
extern "C" int avx2_int8_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t n,
                                   const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads) {
    const int64_t groups = n / Q_COLS, k2 = k / 2;
    auto one_row = [&](const float* xf) {  // each thread its share of the groups (as schedule(static)), in twos
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t g0 = groups / nt * t + (t < groups % nt ? t : groups % nt);
        const int64_t g1 = g0 + groups / nt + (t < groups % nt ? 1 : 0);
        int64_t g = g0;
        for (; g + 1 < g1; g += 2)
            q_row_two_groups(xf, q + g * k * Q_COLS, k2, scale + g * Q_COLS, bias ? bias + g * Q_COLS : nullptr,
                             y + g * Q_COLS);
        if (g < g1)
            q_row_group(xf, q + g * k * Q_COLS, k2, scale + g * Q_COLS, bias ? bias + g * Q_COLS : nullptr,
                        y + g * Q_COLS);
    };
    auto rows = [&](const float* xf) {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < 2 * groups; u++) {  // half groups
            const int64_t g = u / 2, c0 = 16 * (u % 2);
            q_half_rows(xf, k, m, q + g * k * Q_COLS + c0, k2, scale + g * Q_COLS + c0,
                        bias ? bias + g * Q_COLS + c0 : nullptr, y + g * Q_COLS + c0, ldy);
        }
    };
    return on_float_rows(x, m, k, ldx, threads, one_row, rows);
}
