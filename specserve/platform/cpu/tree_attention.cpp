// Attention of a few queries per request over keys read from the KV pool by slot, on CPUs with AVX512-BF16.
//
// q [B, Qmax, H, D] bf16 (any strides but the last: q_sb, q_sq, q_sh); the pool's K and V [S, Hkv, D] bf16;
// slots [B, Kmax] the pool slot of each key column; mask[b * mask_sb + i * mask_sq + k] (uint8, 1 = query row i of
// request b may attend key column k; null = every column visible) -> out [B, Qmax, H, D] bf16. Query head h reads
// KV head h / G (G = H / Hkv), SDPA's GQA grouping.
//
// One work item is a (request, KV head, chunk of query rows). The leading key columns that every row of the chunk
// sees (a verify tree's or a draft level's prefix) are shared: each of their keys and values is read once for all the
// chunk's rows and their G query heads. Per (row, head): its scores key by key (blocks of 16 keys summed by a fixed
// tree), its softmax, then its weighted sum of the values, up to max_group<D> query vectors per pass over the values.
// Scores, the softmax and the weighted sums stay float32 (q . k by vdpbf16ps over pairs of dimensions; exp by a
// polynomial). Each (row, head) takes its keys in column order with the same arithmetic per key whatever shares the
// pass, so a row's result depends only on the keys it sees, never on how many other rows or requests share the call:
// a verify tree's node gets bit for bit what a one-row decode of the same token gets. A row that sees no key gets
// zeros (padding rows; the caller drops them).
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

// One query vector of a work item: a (query row, query head) pair. Its keys are the item's shared columns (every row
// of the item sees them), then its row's own (`rest`, n_rest pool slots, in column order).
struct QueryVec {
    const uint16_t* q;     // D bf16
    float* p;              // its scores, then softmax numerators: shared columns first, then its rest
    const int64_t* rest;   // pool slots of the row's other visible keys
    int64_t n_rest;
    float total;           // sum of the numerators
    uint16_t* out;         // D bf16
};

// the most query vectors whose weighted sums stay in registers at once (24 vectors of sums)
template <int D>
constexpr int max_group() { return 24 / (D / 16) > 0 ? 24 / (D / 16) : 1; }

// NV query vectors' outputs: sum_j p[j] v_j / total over the shared keys (each value converted once for all of
// them) and then each one's rest, in key order, so a vector's sums are the same whatever vectors share the pass
template <int D, int NV>
static void weighted(QueryVec* qv, const uint16_t* vbuf, const int64_t* shared, int64_t n_shared, int64_t stride) {
    __m512 acc[NV][D / 16];
    for (int g = 0; g < NV; g++)
        for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_shared; j++) {
        const uint16_t* val = vbuf + shared[j] * stride;
        __m512 w[NV];
        for (int g = 0; g < NV; g++) w[g] = _mm512_set1_ps(qv[g].p[j]);
        for (int c = 0; c < D / 16; c++) {
            const __m512 v = bf16_to_f32(val + 16 * c);
            for (int g = 0; g < NV; g++) acc[g][c] = _mm512_fmadd_ps(w[g], v, acc[g][c]);
        }
    }
    for (int g = 0; g < NV; g++) {
        const float* pg = qv[g].p + n_shared;
        for (int64_t j = 0; j < qv[g].n_rest; j++) {
            const uint16_t* val = vbuf + qv[g].rest[j] * stride;
            const __m512 w = _mm512_set1_ps(pg[j]);
            for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_fmadd_ps(w, bf16_to_f32(val + 16 * c), acc[g][c]);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / qv[g].total);
        for (int c = 0; c < D / 16; c++)  // round to nearest even, as PyTorch's float -> bf16 cast
            _mm256_storeu_si256((__m256i*)(qv[g].out + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
    }
}

// the first n <= NV vectors of qv (weighted<D, n>)
template <int D, int NV>
static void weighted_upto(QueryVec* qv, int n, const uint16_t* vbuf, const int64_t* shared, int64_t n_shared,
                          int64_t stride) {
    if constexpr (NV > 1)
        if (n < NV) return weighted_upto<D, NV - 1>(qv, n, vbuf, shared, n_shared, stride);
    weighted<D, NV>(qv, vbuf, shared, n_shared, stride);
}

// p[col + j] = scale * q . key j of each of the nq query vectors, for the n keys at pool slots `slots` (D dimensions,
// bf16 pairs by vdpbf16ps, float32 sums), block by block: a block's 16 keys are read from the pool once for all the
// vectors (then from L1). The one place scores are computed: a key's score is the same whatever call, vector group or
// block it is in.
template <int D>
static void scores(QueryVec* qv, int64_t nq, const uint16_t* kbuf, const int64_t* slots, int64_t n, int64_t stride,
                   float scale, int64_t col) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = n - j0 < 16 ? n - j0 : 16;
        const uint16_t* keys[16];
        for (int64_t j = 0; j < m; j++) keys[j] = kbuf + slots[j0 + j] * stride;
        for (int64_t v = 0; v < nq; v++) {
            __m512bh qr[D / 32];
            for (int c = 0; c < D / 32; c++) qr[c] = (__m512bh)_mm512_loadu_si512(qv[v].q + 32 * c);
            __m512 acc[16];
            for (int64_t j = 0; j < 16; j++) {
                acc[j] = _mm512_setzero_ps();
                if (j >= m) continue;
                for (int c = 0; c < D / 32; c++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], qr[c], (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c));
            }
            _mm512_mask_storeu_ps(qv[v].p + col + j0, (__mmask16)((1u << m) - 1), _mm512_mul_ps(sum16(acc), sc));
        }
    }
}

// per-thread scratch: the item's rest slots and their offsets per row, which rows see any key, scores, query vectors
struct Scratch {
    std::vector<int64_t> rest, offsets;
    std::vector<uint8_t> sees;  // per row of the item: it sees some key
    std::vector<float> p;
    std::vector<QueryVec> qv;
};

// One work item: request b, KV head h, query rows [i0, i1). The leading columns every row that sees any key sees
// (for a verify tree or a draft level: the request's prefix) are shared: their keys and values are read once for
// all the rows' G query heads. Each (row, head) still takes its keys in column order with the same arithmetic per
// key, so its result is what it gets alone.
template <int D>
static void item(const uint16_t* q, const uint16_t* kbuf, const uint16_t* vbuf, const int64_t* slots,
                 const uint8_t* mask, int64_t mask_sb, int64_t mask_sq, const Shape& s, int64_t b, int64_t h,
                 int64_t i0, int64_t i1, float scale, uint16_t* out, Scratch& w) {
    const int64_t g_count = s.heads / s.kv_heads, stride = s.kv_heads * D;
    const int64_t* row_slots = slots + b * s.kmax;
    // shared: the shortest leading run of visible columns among the rows that see any key
    w.sees.assign(i1 - i0, 1);
    int64_t shared = s.kmax;
    if (mask) {
        shared = -1;
        for (int64_t i = i0; i < i1; i++) {
            const uint8_t* row = mask + b * mask_sb + i * mask_sq;
            int64_t lead = 0;
            while (lead < s.kmax && row[lead]) lead++;
            bool any = lead > 0;
            for (int64_t k = lead; k < s.kmax && !any; k++) any = row[k] != 0;
            w.sees[i - i0] = any;
            if (any && (shared < 0 || lead < shared)) shared = lead;
        }
        if (shared < 0) shared = 0;
    }
    w.rest.clear();
    w.offsets.assign(1, 0);
    int64_t p_size = 0;
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t* row = mask ? mask + b * mask_sb + i * mask_sq : nullptr;
        const int64_t begin = (int64_t)w.rest.size();
        if (w.sees[i - i0])
            for (int64_t k = shared; k < s.kmax; k++)
                if (!row || row[k]) w.rest.push_back(row_slots[k]);
        w.offsets.push_back((int64_t)w.rest.size());
        p_size += g_count * (shared + (w.offsets.back() - begin) + 16);  // each vector's scores in whole blocks of 16
    }
    w.p.resize(p_size + 16);
    w.qv.clear();
    float* p = w.p.data();
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i - i0, begin = w.offsets[r], n_rest = w.offsets[r + 1] - begin;
        const uint16_t* q_row = q + b * s.q_sb + i * s.q_sq + h * g_count * s.q_sh;  // the row's first query head
        uint16_t* o = out + ((b * s.qmax + i) * s.heads + h * g_count) * D;
        if (!w.sees[r]) {  // sees no key: zeros (padding rows; the caller drops them)
            memset(o, 0, g_count * D * sizeof(uint16_t));
            continue;
        }
        for (int64_t g = 0; g < g_count; g++) {
            w.qv.push_back(QueryVec{q_row + g * s.q_sh, p, w.rest.data() + begin, n_rest, 0.0f, o + g * D});
            p += shared + n_rest + 16;  // whole blocks of 16
        }
    }
    QueryVec* qv = w.qv.data();
    const int64_t nq = (int64_t)w.qv.size();
    scores<D>(qv, nq, kbuf + h * D, row_slots, shared, stride, scale, 0);
    for (int64_t v = 0; v < nq; v++) {
        scores<D>(qv + v, 1, kbuf + h * D, qv[v].rest, qv[v].n_rest, stride, scale, shared);
        qv[v].total = softmax_numerators(qv[v].p, shared + qv[v].n_rest);
    }
    constexpr int G = max_group<D>();
    for (int64_t v = 0; v < nq; v += G) {
        const int n = nq - v < G ? (int)(nq - v) : G;
        weighted_upto<D, G>(qv + v, n, vbuf + h * D, row_slots, shared, stride);
    }
}

// How many chunks a request's query rows go in: the fewest that share the (request, KV head) items evenly among the
// threads (or make at least 4 items a thread), at most one a row. The fewer chunks, the more rows share each key's
// and value's read.
static int64_t row_chunks(int64_t heads_total, int64_t qmax, int threads) {
    int64_t chunks = 1;
    while (chunks < qmax && (heads_total * chunks) % threads != 0 && heads_total * chunks < 4 * threads) chunks++;
    return chunks;
}

// Work items: (request, KV head, a chunk of query rows)
template <int D>
static void run(const uint16_t* q, const uint16_t* kbuf, const uint16_t* vbuf, const int64_t* slots,
                const uint8_t* mask, int64_t mask_sb, int64_t mask_sq, int64_t batch, const Shape& s, float scale,
                uint16_t* out, int threads) {
    const int64_t heads_total = batch * s.kv_heads;
    int64_t chunks = row_chunks(heads_total, s.qmax, threads);
    const int64_t rows = (s.qmax + chunks - 1) / chunks;
    chunks = (s.qmax + rows - 1) / rows;
    const int64_t items = heads_total * chunks;
#pragma omp parallel num_threads(threads)
    {
        Scratch w;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < items; t++) {
            const int64_t b = t / (s.kv_heads * chunks), h = (t / chunks) % s.kv_heads, c = t % chunks;
            const int64_t i0 = c * rows, i1 = i0 + rows < s.qmax ? i0 + rows : s.qmax;
            item<D>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, s, b, h, i0, i1, scale, out, w);
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
