// EntroKV Edge: the Page-EntroKV selection in C, for programs that use the method with
// no Python. Definitions: docs/method.md; the Python controller
// (entrokv_edge/controller) implements the same and a test checks they agree.
//
// For each (layer, group): sink-isolated distributions p of the group's query heads,
// collision c = <p, p>, weights softmax(log(c) / tau) over the group, pooled score
// S = sum_h w_h p_h, page scores (sum or max of S over each page), then the protected
// pages plus the highest-scoring others (ties: lower page first), N pages in all. The
// sum is computed from per-head page sums, which is the same number with less work.
//
// Scores are attention weights: every one must be finite and >= 0 (a NaN, an infinity or a
// negative score is refused with LLAMA_ENTROKV_ERR_INVALID_ARG, as the Python selector
// refuses it with ValueError); an all-zero head gets the uniform distribution. A budget that
// covers the n positions keeps every page, the partial last one included (as in Python).

#include "llama-entrokv.h"
#include "llama-entrokv-impl.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <vector>

extern "C" struct llama_entrokv_params llama_entrokv_default_params(void) {
    llama_entrokv_params p;
    p.budget    = 0;
    p.page_size = 16;
    p.sinks     = 4;
    p.recent    = 32;
    p.tau       = 1.0f;
    p.page_max  = 0;
    return p;
}

static int32_t ceil_div(int64_t a, int64_t b) {
    return (int32_t) ((a + b - 1) / b);
}

extern "C" int32_t llama_entrokv_select_pages(const float * scores, int32_t L, int32_t H, int32_t G, int32_t n,
        const llama_entrokv_params * prm, int32_t * out, size_t n_out) {
    if (scores == nullptr || prm == nullptr || out == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "scores, params or out is NULL");
    }
    if (L < 1 || H < 1 || G < 1 || n < 1 || H % G != 0) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "bad shape: %d layers, %d heads, %d KV heads, %d positions", L, H, G, n);
    }
    const int32_t P = prm->page_size;
    if (P < 1 || prm->sinks < 0 || prm->recent < 1 || !(prm->tau > 0.0f) || !std::isfinite(prm->tau) || prm->budget < 1) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                "bad parameters: page_size %d, sinks %d, recent %d, tau %g, budget %d", P, prm->sinks, prm->recent, prm->tau, prm->budget);
    }
    const size_t n_scores = (size_t) L * H * n;
    for (size_t i = 0; i < n_scores; ++i) {
        if (!(scores[i] >= 0.0f) || !std::isfinite(scores[i])) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                    "scores must be finite and >= 0 (attention weights): scores[%zu][%zu][%zu] = %g",
                    i / ((size_t) H * n), i / (size_t) n % H, i % n, (double) scores[i]);
        }
    }
    const int32_t r       = H / G;
    const int32_t n_pages = ceil_div(n, P);
    std::vector<char> prot(n_pages, 0);
    for (int32_t j = 0; j < ceil_div(std::min(prm->sinks, n), P); ++j) {
        prot[j] = 1;
    }
    for (int32_t j = std::max(0, n_pages - ceil_div(prm->recent, P)); j < n_pages; ++j) {
        prot[j] = 1;
    }
    const int32_t n_prot = (int32_t) std::count(prot.begin(), prot.end(), 1);
    // a budget that covers the positions keeps all of them, the partial last page included
    const int32_t N = prm->budget >= n ? n_pages : std::min(prm->budget / P, n_pages);
    if (N < n_prot) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_LIST_LENGTH,
                "budget of %d tokens = %d pages is below the %d protected pages", prm->budget, N, n_prot);
    }
    if (n_out < (size_t) L * G * N) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BUFFER_SIZE, "out holds %zu values, need %zu", n_out, (size_t) L * G * N);
    }
    const int32_t ks = std::min(prm->sinks, n);
    const double  uniform = 1.0 / std::max(n - ks, 1);

    // per head: page sums of s without the sinks, non-sink mass and sum of squares; the
    // page score of the group is linear in them (the same algebra as the Python controller)
    std::vector<double> pg((size_t) r * n_pages), mass(r), c(r), w(r), S(n), pi(n_pages);
    std::vector<char> flagged(r);
    std::vector<int32_t> order(n_pages);
    for (int32_t l = 0; l < L; ++l) {
        for (int32_t g = 0; g < G; ++g) {
            for (int32_t i = 0; i < r; ++i) {
                const float * s = scores + ((size_t) l * H + (size_t) g * r + i) * n;
                double * ph = pg.data() + (size_t) i * n_pages;
                double m = 0.0, sq = 0.0;
                for (int32_t j = 0; j < n_pages; ++j) {
                    double acc = 0.0;
                    for (int64_t t = std::max<int64_t>((int64_t) j * P, ks); t < std::min<int64_t>(n, ((int64_t) j + 1) * P); ++t) {
                        acc += (double) s[t];
                        sq  += (double) s[t] * (double) s[t];
                    }
                    ph[j] = acc;
                    m += acc;
                }
                flagged[i] = !(m > 0.0);
                mass[i] = m;
                if (flagged[i]) {
                    // all mass on the sinks: the uniform distribution over the other keys
                    for (int32_t j = 0; j < n_pages; ++j) {
                        const int64_t lo = std::max<int64_t>((int64_t) j * P, ks), hi = std::min<int64_t>(n, ((int64_t) j + 1) * P);
                        ph[j] = hi > lo ? (hi - lo) * uniform : 0.0;
                    }
                    c[i] = uniform;
                } else {
                    for (int32_t j = 0; j < n_pages; ++j) { ph[j] /= m; }
                    c[i] = sq / (m * m);
                }
            }
            double mx = -DBL_MAX;
            for (int32_t i = 0; i < r; ++i) {
                w[i] = std::log(std::max(c[i], DBL_MIN)) / prm->tau;
                mx = std::max(mx, w[i]);
            }
            double z = 0.0;
            for (int32_t i = 0; i < r; ++i) { w[i] = std::exp(w[i] - mx); z += w[i]; }
            for (int32_t i = 0; i < r; ++i) { w[i] /= z; }
            if (!prm->page_max) {
                for (int32_t j = 0; j < n_pages; ++j) {
                    double acc = 0.0;
                    for (int32_t i = 0; i < r; ++i) { acc += w[i] * pg[(size_t) i * n_pages + j]; }
                    pi[j] = acc;
                }
            } else {
                // the max needs the pooled token scores
                for (int32_t t = 0; t < n; ++t) {
                    double acc = 0.0;
                    for (int32_t i = 0; i < r; ++i) {
                        const float * s = scores + ((size_t) l * H + (size_t) g * r + i) * n;
                        const double p = t < ks ? 0.0 : (flagged[i] ? uniform : (double) s[t] / mass[i]);
                        acc += w[i] * p;
                    }
                    S[t] = acc;
                }
                for (int32_t j = 0; j < n_pages; ++j) {
                    double v = -DBL_MAX;
                    for (int64_t t = (int64_t) j * P; t < std::min<int64_t>(n, ((int64_t) j + 1) * P); ++t) { v = std::max(v, S[t]); }
                    pi[j] = v;
                }
            }
            for (int32_t j = 0; j < n_pages; ++j) {
                if (prot[j]) {
                    pi[j] = INFINITY;
                } else if (std::isnan(pi[j])) {
                    pi[j] = -DBL_MAX;       // cannot happen with valid scores; keeps the comparison a strict weak order
                }
            }
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return pi[x] > pi[y]; });
            int32_t * o = out + ((size_t) l * G + g) * N;
            std::copy(order.begin(), order.begin() + N, o);
            std::sort(o, o + N);
        }
    }
    llama_entrokv_ok();
    return N;
}

extern "C" int32_t llama_entrokv_evict(llama_context * ctx, llama_seq_id seq_id, const llama_entrokv_params * prm) {
    const llama_entrokv_scores * sc = nullptr;
    if (int32_t rc = llama_entrokv_last_scores(ctx, &sc)) {
        return rc;
    }
    llama_entrokv_geometry geo;
    if (int32_t rc = llama_entrokv_get_geometry(ctx, &geo)) {
        return rc;
    }
    const int32_t n = geo.pos_max + 1;
    if (geo.n_compacted != 0 || (int32_t) geo.n_used != n) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED,
                "llama_entrokv_evict needs a never-compacted cache holding positions 0..%d in cells 0..%d", n - 1, n - 1);
    }
    if (sc->scores == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                "the last observed ubatch has queries only (llama_entrokv_set_query_observer): no attention to evict by");
    }
    if (sc->pos_last != geo.pos_max || sc->n_kv < n || sc->n_layers != geo.n_layers) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                "the last observed ubatch does not end the prompt (observed up to position %d, the cache holds %d)", sc->pos_last, geo.pos_max);
    }
    if (prm == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "params is NULL");
    }
    // the scores of cells 0..n-1 are the scores of positions 0..n-1
    const int32_t L = sc->n_layers, H = sc->n_head, G = sc->n_head_kv;
    std::vector<float> s((size_t) L * H * n);
    for (size_t lh = 0; lh < (size_t) L * H; ++lh) {
        std::copy(sc->scores + lh * sc->n_kv, sc->scores + lh * sc->n_kv + n, s.begin() + lh * n);
    }
    const int32_t n_pages = ceil_div(n, prm->page_size > 0 ? prm->page_size : 1);
    std::vector<int32_t> pages((size_t) L * G * n_pages);
    const int32_t N = llama_entrokv_select_pages(s.data(), L, H, G, n, prm, pages.data(), pages.size());
    if (N < 0) {
        return N;
    }
    // pages -> cells; the last page is protected, so every list has the same length
    std::vector<int32_t> cells, lens((size_t) L * G);
    for (size_t slot = 0; slot < (size_t) L * G; ++slot) {
        const size_t before = cells.size();
        for (int32_t j = 0; j < N; ++j) {
            const int32_t pg = pages[slot * N + j];
            for (int64_t t = (int64_t) pg * prm->page_size; t < std::min<int64_t>(n, ((int64_t) pg + 1) * prm->page_size); ++t) {
                cells.push_back((int32_t) t);
            }
        }
        lens[slot] = (int32_t) (cells.size() - before);
    }
    if (int32_t rc = llama_entrokv_compact(ctx, seq_id, L * G, lens.data(), cells.data(), 0)) {
        return rc;
    }
    if (geo.is_iswa) {
        // the sliding-window cache after it: nothing can be refused here that the compaction accepted,
        // only a backend failure while moving (its message says so)
        if (int32_t rc = llama_entrokv_swa_trim(ctx, seq_id, nullptr)) {
            return rc;
        }
    }
    return lens[0];
}
