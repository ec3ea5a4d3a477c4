// EntroKV Edge: the swap decision of the recall tier, in C++ (the Python runtime's recall,
// entrokv_edge/runtime/recall.py, calls it for every slot at every recall; a test checks it
// against a plain numpy reference).
//
// Per slot (one layer's KV head): the queries of the recall (I tokens x r query heads), their
// attention over the compacted cells (normalised over the cache) and its log-sum-exp, and the
// q.k logits of the stored pages read for it. The read pages and the resident tokens are scored
// together (each query's attention renormalised over the cache plus the read tokens): a page's
// mass is, for the head that gives it most, the sum over the queries of its tokens' attention;
// a resident token's mass the same. The resident tokens form eviction pages of P true positions;
// the whole, unprotected ones are ordered by mass, least first (ties: lower page first). The read
// pages, in descending mass (ties: lower page first), each take the next (tokens / P) of those
// groups, for as long as the page's mass beats the mass of the groups it displaces.

#include "llama-entrokv.h"
#include "llama-entrokv-impl.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

static constexpr int32_t MAX_POS = 1 << 26;     // true positions beyond a context's (64 Mi tokens) are refused

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(ENTROKV_NO_AVX2)
#include <immintrin.h>
#define ENTROKV_PLAN_AVX2 1
#endif

namespace {

// The resident tokens' mass of one slot: res[c] = max over heads h of the sum over tokens i of
// (att[i, h, c] x sc[i, h]) x f[i, h], each product rounded to a float and summed in token order (so
// that both paths below give the same floats: no fused multiply-add). MASS_BLOCK cells at a time, the
// query rows read one after another (a row of the attention is one stream; r x n_tok rows read side by
// side, as a cell-major loop would, are more than the prefetchers follow); acc holds r x MASS_BLOCK sums.
constexpr int32_t MASS_BLOCK = 512;

// one query row's share of a block, cells j0..nc-1: o[j] += (row[j] x a) x b
inline void mass_row(const float * row, float a, float b, float * o, int32_t j0, int32_t nc) {
    for (int32_t j = j0; j < nc; ++j) {
        const float x = row[j] * a;
        o[j] += x * b;
    }
}

// a block's cells j0..nc-1: the largest of the r heads' sums (acc: r rows of MASS_BLOCK), into res
inline void head_max(const float * acc, int32_t r, int32_t j0, int32_t nc, float * res) {
    for (int32_t j = j0; j < nc; ++j) {
        float best = acc[j];
        for (int32_t h = 1; h < r; ++h) {
            best = std::max(best, acc[(size_t) h * MASS_BLOCK + j]);
        }
        res[j] = best;
    }
}

void resident_mass(const float * at, int64_t ld, const float * sc, const float * f, int32_t n_tok, int32_t r,
        int32_t n_keep, float * res, float * acc) {
    for (int32_t c0 = 0; c0 < n_keep; c0 += MASS_BLOCK) {
        const int32_t nc = std::min(MASS_BLOCK, n_keep - c0);
        std::fill(acc, acc + (size_t) r * MASS_BLOCK, 0.0f);
        for (int32_t i = 0; i < n_tok; ++i) {
            for (int32_t h = 0; h < r; ++h) {
                const int32_t q = i * r + h;
                mass_row(at + (size_t) q * ld + c0, sc[q], f[q], acc + (size_t) h * MASS_BLOCK, 0, nc);
            }
        }
        head_max(acc, r, 0, nc, res + c0);
    }
}

#ifdef ENTROKV_PLAN_AVX2
// the same, 8 cells at a time (AVX only: a multiply and an add, never fused)
__attribute__((target("avx"))) void resident_mass_avx(const float * at, int64_t ld, const float * sc, const float * f,
        int32_t n_tok, int32_t r, int32_t n_keep, float * res, float * acc) {
    for (int32_t c0 = 0; c0 < n_keep; c0 += MASS_BLOCK) {
        const int32_t nc = std::min(MASS_BLOCK, n_keep - c0), n8 = nc & ~7;
        std::fill(acc, acc + (size_t) r * MASS_BLOCK, 0.0f);
        for (int32_t i = 0; i < n_tok; ++i) {
            for (int32_t h = 0; h < r; ++h) {
                const int32_t q = i * r + h;
                const float a = sc[q], b = f[q];
                const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
                const float * row = at + (size_t) q * ld + c0;
                float * o = acc + (size_t) h * MASS_BLOCK;
                int32_t j = 0;
                for (; j < n8; j += 8) {
                    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row + j), va);
                    _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_mul_ps(x, vb)));
                }
                mass_row(row, a, b, o, j, nc);
            }
        }
        int32_t j = 0;
        for (; j < n8; j += 8) {
            __m256 best = _mm256_loadu_ps(acc + j);
            for (int32_t h = 1; h < r; ++h) {      // max(acc, best): best where equal, as std::max
                best = _mm256_max_ps(_mm256_loadu_ps(acc + (size_t) h * MASS_BLOCK + j), best);
            }
            _mm256_storeu_ps(res + c0 + j, best);
        }
        head_max(acc, r, j, nc, res + c0);
    }
}

bool plan_avx() {
    static const bool ok = entrokv_simd_allowed() && __builtin_cpu_supports("avx");
    return ok;
}
#endif

} // namespace

static int32_t recall_plan(
        int32_t n_s, int32_t n_tok, int32_t r, int32_t n_keep,
        const float * att, int64_t att_ld, const float * att_scale, const float * w_cache, const float * w_read, const int32_t * ent, int32_t n_read,
        const int32_t * true_pos, const uint8_t * protect, int32_t n_protect,
        int32_t page_size, int32_t store_page, int32_t max_groups,
        int32_t * out_pages, int32_t * out_n_pages, int32_t * out_cells, int32_t * out_n_cells) {
    if (att == nullptr || w_cache == nullptr || true_pos == nullptr || out_pages == nullptr || out_n_pages == nullptr ||
            out_cells == nullptr || out_n_cells == nullptr || (n_read > 0 && (w_read == nullptr || ent == nullptr)) ||
            (n_protect > 0 && protect == nullptr)) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_plan: a NULL array");
    }
    const int32_t P = page_size, page = store_page;
    if (n_s < 0 || n_tok < 1 || r < 1 || n_keep < 1 || att_ld < n_keep || n_read < 0 || n_protect < 0 || P < 1 || page < 1 ||
            page % P != 0 || n_read % page != 0 || max_groups < 0) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                "recall_plan: bad shape (%d slots, %d tokens x %d heads, %d cells, %d read, pages %d / %d, %d groups)",
                n_s, n_tok, r, n_keep, n_read, P, page, max_groups);
    }
    const int32_t nq = n_tok * r;
    int32_t shift = 0;                                  // page_size is usually a power of two: a shift, not a division
    while (((int64_t) 1 << shift) < P) {
        ++shift;
    }
    const bool pow2 = ((int64_t) 1 << shift) == P;
    const int32_t n_pages = n_read / page;
    const double inf = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < (size_t) n_s * nq; ++i) {
        if (!(w_cache[i] >= 0.0f) || !std::isfinite(w_cache[i])) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_plan: w_cache[%zu] = %g is not a finite weight >= 0",
                    i, (double) w_cache[i]);
        }
    }
    std::vector<double> total(nq), page_score(n_pages);
    std::vector<float> tok((size_t) r * n_read), res(n_keep), f(nq), ones(nq, 1.0f), acc((size_t) r * MASS_BLOCK);
    std::vector<int32_t> m(n_pages), po(n_pages), cell_of, owner, touched;
    std::vector<std::pair<double, int32_t>> order;     // (mass, eviction page) of the displaceable pages
    std::vector<double> gsum;
    std::vector<int32_t> gcnt;
    for (int32_t s = 0; s < n_s; ++s) {
        const float * at = att + (size_t) s * nq * att_ld;
        const float * wc = w_cache + (size_t) s * nq;
        const float * wr = w_read ? w_read + (size_t) s * nq * n_read : nullptr;
        const int32_t * en = ent ? ent + (size_t) s * n_read : nullptr;
        const int32_t * tp = true_pos + (size_t) s * n_keep;

        // every query's weights renormalised over the cache and the read tokens together (each query's sum in
        // token order; four queries at a time, their sums apart, so that the additions overlap)
        for (int32_t q0 = 0; q0 < nq; q0 += 4) {
            const int32_t nb = std::min<int32_t>(4, nq - q0);
            double sum[4] = { wc[q0], nb > 1 ? wc[q0 + 1] : 0.0, nb > 2 ? wc[q0 + 2] : 0.0, nb > 3 ? wc[q0 + 3] : 0.0 };
            const float * w0 = wr + (size_t) q0 * n_read;
            if (nb == 4) {
                for (int32_t t = 0; t < n_read; ++t) {
                    if (en[t] >= 0) {
                        sum[0] += w0[t];
                        sum[1] += w0[n_read + t];
                        sum[2] += w0[2 * (size_t) n_read + t];
                        sum[3] += w0[3 * (size_t) n_read + t];
                    }
                }
            } else {
                for (int32_t j = 0; j < nb; ++j) {
                    for (int32_t t = 0; t < n_read; ++t) {
                        sum[j] += en[t] >= 0 ? w0[(size_t) j * n_read + t] : 0.0f;
                    }
                }
            }
            for (int32_t j = 0; j < nb; ++j) {
                const int32_t q = q0 + j;
                if (!(sum[j] > 0.0) || !std::isfinite(sum[j])) {
                    return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                            "recall_plan: slot %d query %d: the weights sum to %g", s, q, sum[j]);
                }
                total[q] = sum[j];
                f[q] = (float) (wc[q] / sum[j]);
            }
        }
        std::fill(tok.begin(), tok.end(), 0.0f);
        for (int32_t i = 0; i < n_tok; ++i) {
            for (int32_t h = 0; h < r; ++h) {
                const int32_t q = i * r + h;
                const float inv = (float) (1.0 / total[q]);
                const float * w = wr + (size_t) q * n_read;
                float * o = tok.data() + (size_t) h * n_read;
                for (int32_t t = 0; t < n_read; ++t) {
                    o[t] += en[t] >= 0 ? w[t] * inv : 0.0f;
                }
            }
        }
        for (int32_t p = 0; p < n_pages; ++p) {
            int32_t cnt = 0;
            double best = -inf;
            for (int32_t h = 0; h < r; ++h) {
                double sum = 0.0;
                for (int32_t t = p * page; t < (p + 1) * page; ++t) {
                    sum += tok[(size_t) h * n_read + t];
                }
                best = std::max(best, sum);
            }
            for (int32_t t = p * page; t < (p + 1) * page; ++t) {
                cnt += en[t] >= 0;
            }
            m[p] = cnt;
            page_score[p] = cnt > 0 ? best : -inf;
        }

        // the resident tokens' mass, renormalised the same way (the attention times its scale rounded as a
        // float, as numpy would have it); its sum per eviction page
        int32_t tp_max = 0;
        for (int32_t c = 0; c < n_keep; ++c) {
            if (tp[c] < 0 || tp[c] >= MAX_POS) {      // the tables below are indexed by true position
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_plan: true_pos[%zu] = %d is outside 0..%d",
                        (size_t) s * n_keep + c, tp[c], MAX_POS - 1);
            }
            tp_max = std::max(tp_max, tp[c]);
        }
        const float * sc = att_scale ? att_scale + (size_t) s * nq : ones.data();
#ifdef ENTROKV_PLAN_AVX2
        if (plan_avx()) {
            resident_mass_avx(at, att_ld, sc, f.data(), n_tok, r, n_keep, res.data(), acc.data());
        } else
#endif
        {
            resident_mass(at, att_ld, sc, f.data(), n_tok, r, n_keep, res.data(), acc.data());
        }
        // the eviction pages the cells hold (tables indexed by page and by true position, grown as needed;
        // only what this slot touched is reset after it)
        const size_t n_gp = (size_t) (tp_max / P) + 1;
        if (gsum.size() < n_gp) {
            gsum.resize(n_gp, 0.0);
            gcnt.resize(n_gp, 0);
            cell_of.resize(n_gp * P, -1);
            owner.resize(n_gp * P, -1);
        }
        touched.clear();
        for (int32_t c = 0; c < n_keep; ++c) {
            const int32_t g = pow2 ? tp[c] >> shift : tp[c] / P;
            if (gcnt[g]++ == 0) {
                touched.push_back(g);
            }
            gsum[g] += res[c];
            if (owner[tp[c]] == s) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_plan: slot %d holds true position %d twice",
                        s, tp[c]);
            }
            owner[tp[c]] = s;
            cell_of[tp[c]] = c;     // every position of a whole page is set here: no reset needed
        }
        // the least attended whole, unprotected groups, at most max_groups of them (ties: lower page first)
        order.clear();
        for (const int32_t g : touched) {
            if (!std::isfinite(gsum[g])) {      // a NaN would break the order below
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_plan: slot %d: the attention is not finite", s);
            }
            if (gcnt[g] == P && !(g < n_protect && protect[g])) {
                order.emplace_back(gsum[g], g);
            }
        }
        const int32_t n_gs = std::min<int32_t>(max_groups, (int32_t) order.size());
        if (n_gs > 0 && n_gs < (int32_t) order.size()) {
            std::nth_element(order.begin(), order.begin() + (n_gs - 1), order.end());
        }
        std::sort(order.begin(), order.begin() + n_gs);

        // the read pages in descending mass (ties: lower page first); each takes the next groups while it wins
        std::iota(po.begin(), po.end(), 0);
        std::stable_sort(po.begin(), po.end(), [&](int32_t a, int32_t b) { return page_score[a] > page_score[b]; });
        int32_t taken = 0, used = 0;
        for (int32_t k = 0; k < n_pages; ++k) {
            const int32_t p = po[k];
            const int32_t need = m[p] / P;
            if (m[p] == 0 || m[p] % P != 0 || used + need > n_gs) {
                break;
            }
            double disp = 0.0;
            for (int32_t j = used; j < used + need; ++j) {
                disp += order[j].first;
            }
            if (!(page_score[p] > disp)) {
                break;
            }
            out_pages[(size_t) s * n_pages + taken++] = p;
            used += need;
        }
        out_n_pages[s] = taken;
        int32_t * cells = out_cells + (size_t) s * n_read;
        for (int32_t j = 0; j < used; ++j) {
            for (int32_t o = 0; o < P; ++o) {
                cells[(size_t) j * P + o] = cell_of[(size_t) order[j].second * P + o];
            }
        }
        out_n_cells[s] = used * P;
        for (const int32_t g : touched) {
            gsum[g] = 0.0;
            gcnt[g] = 0;
        }
    }
    return llama_entrokv_ok();
}

extern "C" int32_t llama_entrokv_recall_plan(
        int32_t n_s, int32_t n_tok, int32_t r, int32_t n_keep,
        const float * att, int64_t att_ld, const float * att_scale, const float * w_cache, const float * w_read,
        const int32_t * ent, int32_t n_read, const int32_t * true_pos, const uint8_t * protect, int32_t n_protect,
        int32_t page_size, int32_t store_page, int32_t max_groups,
        int32_t * out_pages, int32_t * out_n_pages, int32_t * out_cells, int32_t * out_n_cells) {
    try {
        return recall_plan(n_s, n_tok, r, n_keep, att, att_ld, att_scale, w_cache, w_read, ent, n_read, true_pos, protect,
                n_protect, page_size, store_page, max_groups, out_pages, out_n_pages, out_cells, out_n_cells);
    } catch (const std::exception & e) {        // an allocation that failed
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "recall_plan failed: %s", e.what());
    }
}
