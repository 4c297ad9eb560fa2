// The instruction-set-independent part of specserve's few-query attention kernels (tree_attention.cpp for
// AVX512-BF16, tree_attention_avx2.cpp for AVX2 and FMA): the work items and which keys each query vector sees.
//
// q [B, Qmax, H, D] bf16 (any strides but the last: q_sb, q_sq, q_sh); the pool's K and V [S, Hkv, D] bf16;
// slots [B, Kmax] the pool slot of each key column; mask[b * mask_sb + i * mask_sq + k] (uint8, 1 = query row i of
// request b may attend key column k; null = every column visible) -> out [B, Qmax, H, D] bf16. Query head h reads
// KV head h / G (G = H / Hkv), SDPA's GQA grouping.
//
// One work item is a (request, KV head, chunk of query rows). The leading key columns that every row of the chunk
// sees (a verify tree's or a draft level's prefix) are shared: each of their keys and values is read once for all the
// chunk's rows and their G query heads. Per (row, head): its scores key by key, its softmax, then its weighted sum of
// the values. The arithmetic is the instruction set's (its `Isa` struct):
//   Isa::scores<D>(qv, nq, kbuf, slots, n, stride, scale, col): p[col + j] = scale * q . key j for each of the nq
//       query vectors, for the n keys at pool slots `slots`; a key's score must not depend on the call or block;
//   Isa::softmax_numerators(p, n): p[0..n) <- exp(p - max p) -> their sum, lanes by index in p;
//   Isa::weighted_upto<D, NV>(qv, n, vbuf, shared, n_shared, stride): the first n <= NV vectors' outputs, sum_j p[j]
//       v_j / total over the shared keys then each one's rest, in key order, whatever vectors share the pass;
//   Isa::max_group<D>(): the most vectors one such pass takes.
// Each (row, head) thus takes its keys in column order with the same arithmetic per key whatever shares the pass, so
// a row's result depends only on the keys it sees, never on how many other rows or requests share the call: a
// verify tree's node gets bit for bit what a one-row decode of the same token gets. A row that sees no key gets
// zeros (padding rows; the caller drops them).
#pragma once

#include <stdint.h>
#include <string.h>

#include <vector>

struct Shape {
    int64_t qmax, heads, kv_heads, dim, kmax;
    int64_t q_sb, q_sq, q_sh;  // q's strides (elements) over requests, rows and heads; its dimensions are contiguous
};

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
template <int D, class Isa>
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
    Isa::template scores<D>(qv, nq, kbuf + h * D, row_slots, shared, stride, scale, 0);
    for (int64_t v = 0; v < nq; v++) {
        Isa::template scores<D>(qv + v, 1, kbuf + h * D, qv[v].rest, qv[v].n_rest, stride, scale, shared);
        qv[v].total = Isa::softmax_numerators(qv[v].p, shared + qv[v].n_rest);
    }
    constexpr int G = Isa::template max_group<D>();
    for (int64_t v = 0; v < nq; v += G) {
        const int n = nq - v < G ? (int)(nq - v) : G;
        Isa::template weighted_upto<D, G>(qv + v, n, vbuf + h * D, row_slots, shared, stride);
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
template <int D, class Isa>
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
            item<D, Isa>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, s, b, h, i0, i1, scale, out, w);
        }
    }
}

// The kernel's entry point with Isa's arithmetic. dim: 32, 64, 128 or 256 (the caller checks; any other returns
// without writing); heads a multiple of kv_heads, at most 64 of them per KV head.
template <class Isa>
static void attend(const uint16_t* q, int64_t q_sb, int64_t q_sq, int64_t q_sh, const uint16_t* kbuf,
                   const uint16_t* vbuf, const int64_t* slots, const uint8_t* mask, int64_t mask_sb, int64_t mask_sq,
                   int64_t batch, int64_t qmax, int64_t heads, int64_t kv_heads, int64_t dim, int64_t kmax,
                   float scale, uint16_t* out, int threads) {
    const Shape s{qmax, heads, kv_heads, dim, kmax, q_sb, q_sq, q_sh};
    switch (dim) {
        case 32: run<32, Isa>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, s, scale, out, threads); break;
        case 64: run<64, Isa>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, s, scale, out, threads); break;
        case 128: run<128, Isa>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, s, scale, out, threads); break;
        case 256: run<256, Isa>(q, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, s, scale, out, threads); break;
        default: break;
    }
}
