// elementwise.cpp's kernels for CPUs with AVX2 and FMA but no AVX512: RMSNorm, SiLU times up, rotary embedding and
// the exponential race's noise, each in one pass, 8 lanes at a time (a row's last n < 8 values through a small
// buffer). Same contracts and the same rounding points as there: each row on its own, float32 arithmetic, bf16
// where the eager operators store bf16. SiLU, RoPE and the race noise take the AVX512 kernels' operations in the same
// order (simd_avx2.h); RMSNorm sums its squares in 8 lanes, so its sum may round differently from theirs.
#include "simd_avx2.h"

// the 8 lanes' sum
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// x [rows, d] (row stride ldx) bf16, weight [d] bf16 -> out [rows, d] (contiguous):
// weight * bf16(x * rsqrt(mean(x^2) + eps))
extern "C" void rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t d, int64_t ldx, const uint16_t* weight,
                              float eps, uint16_t* out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * ldx;
        uint16_t* o = out + r * d;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 v = load_bf16_8(xr + i, d - i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 s = _mm256_set1_ps(1.0f / __builtin_sqrtf(hsum8(acc) / (float)d + eps));
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 normed = round_bf16_8(_mm256_mul_ps(load_bf16_8(xr + i, d - i), s));
            store_bf16_8(o + i, _mm256_mul_ps(normed, load_bf16_8(weight + i, d - i)), d - i);
        }
    }
}

// gate_up [rows, 2n] (row stride ldg) bf16 -> out [rows, n]: bf16(silu(gate)) * up, silu(g) = g / (1 + e^-g)
extern "C" void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t n, int64_t ldg, uint16_t* out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* g = gate_up + r * ldg;
        uint16_t* o = out + r * n;
        for (int64_t i = 0; i < n; i += 8) {
            const __m256 gv = load_bf16_8(g + i, n - i);
            const __m256 act = round_bf16_8(
                _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
            store_bf16_8(o + i, _mm256_mul_ps(act, load_bf16_8(g + n + i, n - i)), n - i);
        }
    }
}

// x [tokens, heads, d] bf16 (strides sx_t, sx_h; d contiguous); cos / sin [tokens, d] (row strides sc, ss) holding
// cos | cos and -sin | sin -> out [tokens, heads, d] (contiguous): x * cos + cat(x2, x1) * sin, neox-style (halves)
extern "C" void rope_bf16(const uint16_t* x, int64_t tokens, int64_t heads, int64_t d, int64_t sx_t, int64_t sx_h,
                          const uint16_t* cos, int64_t sc, const uint16_t* sin, int64_t ss, uint16_t* out) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t* c = cos + t * sc;
        const uint16_t* s = sin + t * ss;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t* xh = x + t * sx_t + h * sx_h;
            uint16_t* o = out + (t * heads + h) * d;
            for (int64_t i = 0; i < half; i += 8) {
                const int64_t m = half - i;
                const __m256 x1 = load_bf16_8(xh + i, m), x2 = load_bf16_8(xh + half + i, m);
                const __m256 lo = _mm256_add_ps(round_bf16_8(_mm256_mul_ps(x1, load_bf16_8(c + i, m))),
                                                round_bf16_8(_mm256_mul_ps(x2, load_bf16_8(s + i, m))));
                const __m256 hi = _mm256_add_ps(round_bf16_8(_mm256_mul_ps(x2, load_bf16_8(c + half + i, m))),
                                                round_bf16_8(_mm256_mul_ps(x1, load_bf16_8(s + half + i, m))));
                store_bf16_8(o + i, lo, m);
                store_bf16_8(o + half + i, hi, m);
            }
        }
    }
}

// murmur3's 32-bit finaliser on each lane
static inline __m256i fmix32(__m256i z) {
    z = _mm256_xor_si256(z, _mm256_srli_epi32(z, 16));
    z = _mm256_mullo_epi32(z, _mm256_set1_epi32((int)0x85EBCA6Bu));
    z = _mm256_xor_si256(z, _mm256_srli_epi32(z, 13));
    z = _mm256_mullo_epi32(z, _mm256_set1_epi32((int)0xC2B2AE35u));
    return _mm256_xor_si256(z, _mm256_srli_epi32(z, 16));
}

// The exponential race's noise, as elementwise.cpp's race_exponentials: for row r's keys (k1[r], k2[r]) and token
// ids [m] (row stride ldi; 0: the same ids for every row) -> out [rows, m] float32 (row stride ldo)
extern "C" void race_exponentials(const int32_t* k1, const int32_t* k2, int64_t rows, const int32_t* ids,
                                  int64_t ldi, int64_t m, float* out, int64_t ldo) {
    const __m256i phi = _mm256_set1_epi32((int)0x9E3779B9u);
    const __m256 half = _mm256_set1_ps(0.5f), scale = _mm256_set1_ps(1.0f / (1 << 23)), one = _mm256_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++) {
        const __m256i a = _mm256_set1_epi32(k1[r]), b = _mm256_set1_epi32(k2[r]);
        const int32_t* id = ids + r * ldi;
        float* o = out + r * ldo;
        for (int64_t j = 0; j < m; j += 8) {
            const int64_t n = m - j;
            int32_t ibuf[8] = {0};
            if (n < 8) memcpy(ibuf, id + j, (size_t)n * sizeof(int32_t));
            const __m256i v = _mm256_loadu_si256((const __m256i*)(n < 8 ? ibuf : id + j));
            const __m256i z = fmix32(_mm256_xor_si256(fmix32(_mm256_add_epi32(_mm256_mullo_epi32(v, phi), a)), b));
            const __m256 w = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(z, 9)), half), scale);
            const __m256 e = _mm256_sub_ps(_mm256_setzero_ps(), log8(_mm256_sub_ps(one, w)));
            if (n >= 8) {
                _mm256_storeu_ps(o + j, e);
            } else {
                float fbuf[8];
                _mm256_storeu_ps(fbuf, e);
                memcpy(o + j, fbuf, (size_t)n * sizeof(float));
            }
        }
    }
}
