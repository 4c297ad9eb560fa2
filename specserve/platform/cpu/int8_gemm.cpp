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
// for a single row), added at the end. A tile of up to 4 rows streams the weights from memory once; more rows re-read
// the group (K x 32 bytes) from the core's L2. Threads split the column groups (OpenMP: the runtime PyTorch itself
// uses, linked by the loader).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

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

// R rows (up to 4) of one column group; even steps into the first set of sums, odd steps into the second. xf: a
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

// xf: the last row's x in fp32 where it makes a tile of its own (m % 4 == 1), else null
static void group_rows(const uint16_t* x, const float* xf, int64_t ldx, int64_t m, int64_t k2, const int8_t* qg,
                       const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const uint16_t* xs = x + r0 * ldx;
        uint16_t* ys = y + r0 * ldy;
        switch (m - r0 < 4 ? m - r0 : 4) {
            case 1: tile<1>(xs, xf, ldx, k2, qg, scale, bias, ys, ldy); break;
            case 2: tile<2>(xs, nullptr, ldx, k2, qg, scale, bias, ys, ldy); break;
            case 3: tile<3>(xs, nullptr, ldx, k2, qg, scale, bias, ys, ldy); break;
            default: tile<4>(xs, nullptr, ldx, k2, qg, scale, bias, ys, ldy); break;
        }
    }
}

// x: m rows of k bf16 (row stride ldx), k even; q: packed, n a multiple of 32; scale: n floats; bias: n floats or
// null; y: m rows of n bf16 (row stride ldy).
extern "C" void int8_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t n,
                               const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads) {
    static thread_local std::vector<float> buf;  // the calling thread's fp32 copy of a lone row, kept between calls
    const float* xf = nullptr;
    if (m % 4 == 1) {
        if ((int64_t)buf.size() < k) buf.resize(k);
        const uint16_t* last = x + (m - 1) * ldx;
        for (int64_t j = 0; j < k; j++) {
            uint32_t bits = (uint32_t)last[j] << 16;  // bf16 is fp32's upper half
            memcpy(&buf[j], &bits, 4);
        }
        xf = buf.data();
    }
    const int64_t groups = n / COLS, k2 = k / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        group_rows(x, xf, ldx, m, k2, q + g * k * COLS, scale + g * COLS, bias ? bias + g * COLS : nullptr,
                   y + g * COLS, ldy);
}
