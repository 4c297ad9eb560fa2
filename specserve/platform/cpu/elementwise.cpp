// The element-wise steps of a bf16 decoder layer, each in one pass, on CPUs with AVX512: RMSNorm, SiLU times up,
// and rotary embedding. Eager PyTorch runs each as several operators (RMSNorm alone: a cast, a power, a mean, an add,
// a reciprocal square root, two multiplies and a cast back), each a dispatch and a pass over memory.
//
// Each rounds to bf16 where the eager operators store a bf16 tensor, and works on one row at a time, so a row's
// result never depends on the other rows of a call: a verify tree's row gets what a one-row decode of it gets.
// Arithmetic is float32 throughout. RoPE is bit for bit PyTorch's; RMSNorm sums the squares in its own order and
// SiLU takes e^x from a polynomial, so a value can land one bf16 step from PyTorch's where the float32 result lies
// next to a rounding boundary.
#include <string.h>

#include "simd.h"

// x [rows, d] (row stride ldx) bf16, weight [d] bf16 -> out [rows, d] (contiguous):
// weight * bf16(x * rsqrt(mean(x^2) + eps))
extern "C" void rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t d, int64_t ldx, const uint16_t* weight,
                              float eps, uint16_t* out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * ldx;
        uint16_t* o = out + r * d;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __m512 v = bf16_to_f32(xr + i, lanes(d - i));
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float inv = 1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(acc) / (float)d + eps);
        const __m512 s = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = lanes(d - i);
            const __m512 normed = round_bf16(_mm512_mul_ps(bf16_to_f32(xr + i, m), s));
            store_bf16(o + i, _mm512_mul_ps(normed, bf16_to_f32(weight + i, m)), m);
        }
    }
}

// gate_up [rows, 2n] (row stride ldg) bf16 -> out [rows, n]: bf16(silu(gate)) * up, silu(g) = g / (1 + e^-g)
extern "C" void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t n, int64_t ldg, uint16_t* out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* g = gate_up + r * ldg;
        uint16_t* o = out + r * n;
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = lanes(n - i);
            const __m512 gv = bf16_to_f32(g + i, m);
            const __m512 act = round_bf16(_mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
            store_bf16(o + i, _mm512_mul_ps(act, bf16_to_f32(g + n + i, m)), m);
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
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 m = lanes(half - i);
                const __m512 x1 = bf16_to_f32(xh + i, m), x2 = bf16_to_f32(xh + half + i, m);
                const __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, bf16_to_f32(c + i, m))),
                                                round_bf16(_mm512_mul_ps(x2, bf16_to_f32(s + i, m))));
                const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, bf16_to_f32(c + half + i, m))),
                                                round_bf16(_mm512_mul_ps(x1, bf16_to_f32(s + half + i, m))));
                store_bf16(o + i, lo, m);
                store_bf16(o + half + i, hi, m);
            }
        }
    }
}

// murmur3's 32-bit finaliser on each lane
static inline __m512i fmix32(__m512i z) {
    z = _mm512_xor_si512(z, _mm512_srli_epi32(z, 16));
    z = _mm512_mullo_epi32(z, _mm512_set1_epi32((int)0x85EBCA6Bu));
    z = _mm512_xor_si512(z, _mm512_srli_epi32(z, 13));
    z = _mm512_mullo_epi32(z, _mm512_set1_epi32((int)0xC2B2AE35u));
    return _mm512_xor_si512(z, _mm512_srli_epi32(z, 16));
}

// The exponential race's noise (specserve/sampling/race.py, ``_exponentials``): for row r's keys (k1[r], k2[r]) and
// token ids [m] (row stride ldi; 0: the same ids for every row) -> out [rows, m] float32 (row stride ldo),
// z = fmix(fmix(id * 0x9E3779B9 + k1) ^ k2), w = ((z >> 9) + 0.5) / 2^23, E = -ln(1 - w) (1 - w is exact in float32)
extern "C" void race_exponentials(const int32_t* k1, const int32_t* k2, int64_t rows, const int32_t* ids,
                                  int64_t ldi, int64_t m, float* out, int64_t ldo) {
    const __m512i phi = _mm512_set1_epi32((int)0x9E3779B9u);
    const __m512 half = _mm512_set1_ps(0.5f), scale = _mm512_set1_ps(1.0f / (1 << 23)), one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++) {
        const __m512i a = _mm512_set1_epi32(k1[r]), b = _mm512_set1_epi32(k2[r]);
        const int32_t* id = ids + r * ldi;
        float* o = out + r * ldo;
        for (int64_t j = 0; j < m; j += 16) {
            const __mmask16 lane = lanes(m - j);
            const __m512i v = _mm512_maskz_loadu_epi32(lane, id + j);
            const __m512i z = fmix32(_mm512_xor_si512(fmix32(_mm512_add_epi32(_mm512_mullo_epi32(v, phi), a)), b));
            const __m512 w = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(z, 9)), half), scale);
            const __m512 e = _mm512_sub_ps(_mm512_setzero_ps(), log_ps(_mm512_sub_ps(one, w)));
            _mm512_mask_storeu_ps(o + j, lane, e);
        }
    }
}
