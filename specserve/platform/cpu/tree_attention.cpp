// Attention of a few queries per request over keys read from the KV pool by slot, on CPUs with AVX512-BF16.
//
// q [B, Qmax, H, D] bf16 (any strides but the last: q_sb, q_sq, q_sh); the pool's K and V [S, Hkv, D] bf16;
// slots [B, Kmax] the pool slot of each key column; mask[b * mask_sb + i * mask_sq + k] (uint8, 1 = query row i of
// request b may attend key column k; null = every column visible) -> out [B, Qmax, H, D] bf16. Query head h reads
// KV head h / G (G = H / Hkv), SDPA's GQA grouping.
//
// One work item is a (request, KV head, query row): its G query heads' scores, key by key (blocks of 16 keys summed
// by a fixed tree), then their weighted sums of the values, up to 4 heads per pass over the values. Scores, the
// softmax and the weighted sums stay float32 (q . k by vdpbf16ps over pairs of dimensions; exp by a polynomial).
// Keys are taken in column order, so a row's result depends only on the keys it sees, never on how many other
// rows or requests share the call: a verify tree's node gets bit for bit what a one-row decode of the same token
// gets. A row that sees no key gets zeros (padding rows; the caller drops them).
#include <string.h>

#include <vector>

#include "simd.h"

// 16 vectors of partial sums -> one vector holding each one's total (lane j: v[j]'s), by a fixed tree of adds that is
// the same for every lane, so a key's score does not depend on its place in a block
static inline __m512 sum16(const __m512* v) {
    __m512 s[8], w[4];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
    const __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
    // lanes of w[0..3] in order, each lane's 4 values already its 4 keys' sums over that lane
    return _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, 0x88), _mm512_shuffle_f32x4(p01, p23, 0xDD));
}

struct Shape {
    int64_t qmax, heads, kv_heads, dim, kmax;
    int64_t q_sb, q_sq, q_sh;  // q's strides (elements) over requests, rows and heads; its dimensions are contiguous
};

// scores[j] = scale * q . key j for the n keys at `seen` (D dimensions, bf16 pairs by vdpbf16ps, float32 sums)
template <int D>
static void scores(const uint16_t* q, const uint16_t* kbuf, const int64_t* seen, int64_t n, int64_t stride,
                   float scale, float* out) {
    __m512bh qv[D / 32];
    for (int c = 0; c < D / 32; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = n - j0 < 16 ? n - j0 : 16;
        __m512 acc[16];
        for (int64_t j = 0; j < 16; j++) {
            acc[j] = _mm512_setzero_ps();
            if (j >= m) continue;
            const uint16_t* key = kbuf + seen[j0 + j] * stride;
            for (int c = 0; c < D / 32; c++)
                acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
        }
        _mm512_mask_storeu_ps(out + j0, (__mmask16)((1u << m) - 1), _mm512_mul_ps(sum16(acc), sc));
    }
}

// For G query heads at once: out[g] (D bf16) = sum_j p[g][j] v_j / totals[g], the values at `seen`, in key order
// (each value converted once for the G heads; every head's sums in the same order as alone)
template <int D, int G>
static void weighted(const float* p, int64_t p_stride, const uint16_t* vbuf, const int64_t* seen, int64_t n,
                     int64_t stride, const float* totals, uint16_t* out) {
    __m512 acc[G][D / 16];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const uint16_t* val = vbuf + seen[j] * stride;
        __m512 w[G];
        for (int g = 0; g < G; g++) w[g] = _mm512_set1_ps(p[g * p_stride + j]);
        for (int c = 0; c < D / 16; c++) {
            const __m512 v = bf16_to_f32(val + 16 * c);
            for (int g = 0; g < G; g++) acc[g][c] = _mm512_fmadd_ps(w[g], v, acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / totals[g]);
        for (int c = 0; c < D / 16; c++)  // round to nearest even, as PyTorch's float -> bf16 cast
            _mm256_storeu_si256((__m256i*)(out + g * D + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
    }
}

// the G heads' weighted sums, as many heads at a time as keep their sums in registers (at most 24 vectors)
template <int D>
static void weighted_heads(const float* p, int64_t p_stride, const uint16_t* vbuf, const int64_t* seen, int64_t n,
                           int64_t stride, const float* totals, int64_t g_count, uint16_t* out) {
    int64_t g = 0;
    if (4 * D <= 384)
        for (; g + 4 <= g_count; g += 4)
            weighted<D, 4>(p + g * p_stride, p_stride, vbuf, seen, n, stride, totals + g, out + g * D);
    if (3 * D <= 384)
        for (; g + 3 <= g_count; g += 3)
            weighted<D, 3>(p + g * p_stride, p_stride, vbuf, seen, n, stride, totals + g, out + g * D);
    if (2 * D <= 384)
        for (; g + 2 <= g_count; g += 2)
            weighted<D, 2>(p + g * p_stride, p_stride, vbuf, seen, n, stride, totals + g, out + g * D);
    for (; g < g_count; g++) weighted<D, 1>(p + g * p_stride, p_stride, vbuf, seen, n, stride, totals + g, out + g * D);
}

// the lanes of the block of 16 at j that lie below n
static inline __mmask16 tail_mask(int64_t j, int64_t n) {
    return n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
}

// p[0..n) <- exp(p - max p) -> their sum
static float softmax_numerators(float* p, int64_t n) {
    __m512 top = _mm512_set1_ps(p[0]);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(j, n);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, p + j));
    }
    const __m512 topv = _mm512_set1_ps(_mm512_reduce_max_ps(top));  // the maximum, exactly as a scalar loop's
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(j, n);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), topv));
        _mm512_mask_storeu_ps(p + j, m, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(total);
}

// one (request b, KV head h, query row i): its G heads' outputs
template <int D>
static void item(const uint16_t* q, const uint16_t* kbuf, const uint16_t* vbuf, const int64_t* slots,
                 const uint8_t* mask_row, const Shape& s, int64_t b, int64_t h, int64_t i, float scale, uint16_t* out,
                 std::vector<int64_t>& seen, std::vector<float>& p) {
    const int64_t g_count = s.heads / s.kv_heads, stride = s.kv_heads * D;
    const int64_t* row_slots = slots + b * s.kmax;
    seen.clear();
    for (int64_t k = 0; k < s.kmax; k++)
        if (!mask_row || mask_row[k]) seen.push_back(row_slots[k]);
    const int64_t n = (int64_t)seen.size();
    const uint16_t* q_item = q + b * s.q_sb + i * s.q_sq + h * g_count * s.q_sh;  // the item's first query head
    uint16_t* o = out + ((b * s.qmax + i) * s.heads + h * g_count) * D;
    if (n == 0) {
        memset(o, 0, g_count * D * sizeof(uint16_t));
        return;
    }
    const int64_t p_stride = n + 16;  // a head's scores, rounded up to whole blocks of 16
    p.resize(g_count * p_stride + 64);
    float* totals = p.data() + g_count * p_stride;  // g_count <= 64 (the caller checks)
    for (int64_t g = 0; g < g_count; g++) {
        float* pg = p.data() + g * p_stride;
        scores<D>(q_item + g * s.q_sh, kbuf + h * D, seen.data(), n, stride, scale, pg);
        totals[g] = softmax_numerators(pg, n);
    }
    weighted_heads<D>(p.data(), p_stride, vbuf + h * D, seen.data(), n, stride, totals, g_count, o);
}

template <int D>
static void run(const uint16_t* q, const uint16_t* kbuf, const uint16_t* vbuf, const int64_t* slots,
                const uint8_t* mask, int64_t mask_sb, int64_t mask_sq, int64_t batch, const Shape& s, float scale,
                uint16_t* out, int threads) {
    const int64_t items = batch * s.kv_heads * s.qmax;
#pragma omp parallel num_threads(threads)
    {
        std::vector<int64_t> seen;
        std::vector<float> p;
        seen.reserve(s.kmax);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < items; t++) {
            const int64_t b = t / (s.kv_heads * s.qmax), h = (t / s.qmax) % s.kv_heads, i = t % s.qmax;
            const uint8_t* mask_row = mask ? mask + b * mask_sb + i * mask_sq : nullptr;
            item<D>(q, kbuf, vbuf, slots, mask_row, s, b, h, i, scale, out, seen, p);
        }
    }
}

// dim: 32, 64, 128 or 256 (the caller checks; any other returns without writing); heads a multiple of kv_heads,
// at most 64 of them per KV head.
extern "C" void tree_attention_bf16(const uint16_t* q, int64_t q_sb, int64_t q_sq, int64_t q_sh,
                                    const uint16_t* kbuf, const uint16_t* vbuf, const int64_t* slots,
                                    const uint8_t* mask, int64_t mask_sb, int64_t mask_sq, int64_t batch,
                                    int64_t qmax, int64_t heads, int64_t kv_heads, int64_t dim, int64_t kmax,
                                    float scale, uint16_t* out, int threads) {
    const Shape s{qmax, heads, kv_heads, dim, kmax, q_sb, q_sq, q_sh};
    switch (dim) {
        case 32: run<32>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, s, scale, out, threads); break;
        case 64: run<64>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, s, scale, out, threads); break;
        case 128: run<128>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, s, scale, out, threads); break;
        case 256: run<256>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, s, scale, out, threads); break;
        default: break;
    }
}
