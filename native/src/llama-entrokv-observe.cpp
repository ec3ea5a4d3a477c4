// EntroKV Edge: observation-window scoring inside llama.cpp's graph.
//
// For an observed ubatch (>= w tokens) every eligible layer adds a few nodes after its
// attention: the last w queries against the cached keys, with the model's own scale,
// softcap, mask and sinks, softmax, then the mean over the w queries -> [n_kv, n_head].
// The nodes run on whatever backend the scheduler assigns (the one holding the cache);
// their temporaries are freed by the graph allocator once used, so only the [n_kv, n_head]
// result of each layer stays. The decode observer computes no attention: it keeps the softmax
// the layer made anyway (flash attention off) for the ubatch's last token. After the ubatch,
// llama_context hands the results to us; we copy them to one host buffer (the only
// device-to-host copy), attach the true positions of every (layer, KV head) slot, and call the
// observer.

#include "llama-entrokv.h"
#include "llama-entrokv-impl.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

// the name prefix of the query outputs (the scores are "entrokv_scores-<il>")
#define ENTROKV_Q_PREFIX "entrokv_q-"
// ... and of the decode observer's attention rows
#define ENTROKV_ROWS_PREFIX "entrokv_rows-"
// cparams.entrokv_window: the window, this bit when only the queries are observed, and that one when
// each ubatch's last token also hands over the model's own attention (the decode observer; a different
// graph: the graph parameters compare the whole value)
#define ENTROKV_QUERIES_ONLY 0x80000000u
#define ENTROKV_ROWS         0x40000000u
#define ENTROKV_FLAGS        (ENTROKV_QUERIES_ONLY | ENTROKV_ROWS)

// The softmax of the attention whose output is `out`: without flash attention, build_attn_mha computes
// kq = softmax(k . q) [n_kv, n_tokens, n_head] and then v . kq; the nearest softmax among out's sources
// (breadth first, a few steps) is it. nullptr where there is none of that shape (flash attention), or where
// its logits are not the product k . q itself (a softcap or a bias added in between).
static ggml_tensor * attention_soft_max(ggml_tensor * out, int64_t n_kv, int64_t n_tokens, int64_t n_head) {
    std::vector<ggml_tensor *> level {out}, next;
    for (int depth = 0; depth < 5 && !level.empty(); ++depth) {
        for (ggml_tensor * t : level) {
            if (t->op == GGML_OP_SOFT_MAX) {
                const bool ok = t->type == GGML_TYPE_F32 && t->ne[0] == n_kv && t->ne[1] == n_tokens && t->ne[2] == n_head &&
                        t->ne[3] == 1 && ggml_is_contiguous(t) && t->src[0] != nullptr && t->src[0]->op == GGML_OP_MUL_MAT;
                return ok ? t : nullptr;
            }
            for (ggml_tensor * src : t->src) {
                if (src != nullptr) {
                    next.push_back(src);
                }
            }
        }
        level.swap(next);
        next.clear();
    }
    return nullptr;
}

void llama_entrokv_observe(const llm_graph_context & g, ggml_tensor * q, ggml_tensor * k, ggml_tensor * kq_mask,
        ggml_tensor * sinks, float kq_scale, int il, ggml_tensor * out) {
    const bool    q_only = (g.cparams.entrokv_window & ENTROKV_QUERIES_ONLY) != 0;
    const bool    rows   = (g.cparams.entrokv_window & ENTROKV_ROWS) != 0;
    const int64_t w      = g.cparams.entrokv_window & ~ENTROKV_FLAGS;
    if (w <= 0 || q->ne[2] < w || k->ne[3] != 1 || g.arch == LLM_ARCH_GROK) {
        return;
    }
    ggml_context * ctx0 = g.ctx0;
    const int64_t T      = q->ne[2];
    const int64_t n_head = q->ne[1];
    const int64_t n_kv   = k->ne[2];
    if (!q_only) {      // the attention over the cache: the scores
        // the last w queries: [hd, n_head, w] -> [hd, w, n_head]
        ggml_tensor * qw = ggml_view_3d(ctx0, q, q->ne[0], n_head, w, q->nb[1], q->nb[2], (T - w) * q->nb[2]);
        qw = ggml_permute(ctx0, qw, 0, 2, 1, 3);
        // cached keys [hd, n_head_kv, n_kv] -> [hd, n_kv, n_head_kv]; mul_mat broadcasts query head h to KV head h / r
        ggml_tensor * kp = ggml_permute(ctx0, ggml_view_3d(ctx0, k, k->ne[0], k->ne[1], n_kv, k->nb[1], k->nb[2], 0), 0, 2, 1, 3);

        ggml_tensor * kq = ggml_mul_mat(ctx0, kp, qw);                    // [n_kv, w, n_head]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        if (g.hparams.attn_soft_cap) {
            kq = ggml_scale(ctx0, kq, 1.0f / g.hparams.f_attn_logit_softcapping);
            kq = ggml_tanh (ctx0, kq);
            kq = ggml_scale(ctx0, kq, g.hparams.f_attn_logit_softcapping);
        }
        // the mask rows of the window queries
        ggml_tensor * mask = ggml_view_4d(ctx0, kq_mask, kq_mask->ne[0], w, 1, 1,
                kq_mask->nb[1], kq_mask->nb[2], kq_mask->nb[3], (T - w) * kq_mask->nb[1]);
        kq = ggml_soft_max_ext(ctx0, kq, mask, kq_scale, g.hparams.f_max_alibi_bias);
        ggml_soft_max_add_sinks(kq, sinks);

        // mean over the window queries: [n_kv, w, n_head] -> [w, n_kv, n_head] -> sum -> [n_kv, n_head]
        ggml_tensor * t = ggml_cont(ctx0, ggml_permute(ctx0, kq, 1, 0, 2, 3));
        t = ggml_sum_rows(ctx0, t);
        t = ggml_scale(ctx0, t, 1.0f / (float) w);
        t = ggml_reshape_2d(ctx0, t, n_kv, n_head);
        ggml_format_name(t, "entrokv_scores-%d", il);
        // an output: the allocator must not reuse its memory, and backends must not fuse it away
        ggml_set_output(t);

        ggml_build_forward_expand(g.gf, t);
        g.res->t_entrokv.push_back(t);
        g.res->t_entrokv_il.push_back(il);
    }

    // the decode observer: the model's own attention of the ubatch's last token over the cache, kept as an
    // output. Only where a logit is q . k (no softcap, bias or ALiBi: what the queries are for) and the
    // rows are the attention over the cells alone (no sinks). Every graph of the observer has this output, the
    // reserved worst case too: a graph's allocation plan is reused for graphs of the same node count, so an output
    // that only some graphs flagged could be overwritten.
    if (rows && sinks == nullptr && out != nullptr && !g.hparams.attn_soft_cap && g.hparams.f_max_alibi_bias == 0.0f) {
        ggml_tensor * sm = attention_soft_max(out, n_kv, T, n_head);
        if (sm != nullptr) {
            // one token: the softmax is the row [n_kv, 1, n_head] itself, kept as an output (no copy in the graph);
            // a longer ubatch's last row is copied, and those copy nodes keep its graph's node count apart from a
            // one-token graph's, so that neither runs on the other's allocation plan
            ggml_tensor * r = sm;
            if (T > 1) {
                r = ggml_cont(ctx0, ggml_view_3d(ctx0, sm, n_kv, 1, n_head, sm->nb[1], sm->nb[2], (T - 1) * sm->nb[1]));
            }
            ggml_format_name(r, "%s%d", ENTROKV_ROWS_PREFIX, il);
            ggml_set_output(r);
            ggml_build_forward_expand(g.gf, r);
            g.res->t_entrokv.push_back(r);
            g.res->t_entrokv_il.push_back(il);
        }
    }

    // the window's queries, scaled as attention scales them: [hd, n_head, w], one more output
    // (told apart from the scores by its name when the ubatch is done)
    ggml_tensor * qo = ggml_cont(ctx0, ggml_view_3d(ctx0, q, q->ne[0], n_head, w, q->nb[1], q->nb[2], (T - w) * q->nb[2]));
    if (qo->type != GGML_TYPE_F32) {
        qo = ggml_cast(ctx0, qo, GGML_TYPE_F32);
    }
    qo = ggml_scale(ctx0, qo, kq_scale);
    ggml_format_name(qo, "%s%d", ENTROKV_Q_PREFIX, il);
    ggml_set_output(qo);
    ggml_build_forward_expand(g.gf, qo);
    g.res->t_entrokv.push_back(qo);
    g.res->t_entrokv_il.push_back(il);
}

//
// per-context observer state
//

struct entrokv_observer_state {
    int32_t                window    = 0;
    llama_entrokv_observer cb        = nullptr;
    void *                 user_data = nullptr;

    std::vector<float>   scores;
    std::vector<float>   queries;
    std::vector<float>   rows;
    std::vector<int32_t> true_pos;
    std::vector<int32_t> layer_ids;
    llama_entrokv_scores view {};
    bool                 have = false;
};

static std::mutex g_obs_mutex;
static std::unordered_map<const llama_context *, std::unique_ptr<entrokv_observer_state>> g_obs;

static entrokv_observer_state * find_state(const llama_context * ctx) {
    std::lock_guard<std::mutex> lock(g_obs_mutex);
    auto it = g_obs.find(ctx);
    return it == g_obs.end() ? nullptr : it->second.get();
}

void llama_entrokv_access::on_context_free(llama_context * lctx) {
    std::lock_guard<std::mutex> lock(g_obs_mutex);
    g_obs.erase(lctx);
}

int32_t llama_entrokv_access::set_observer(llama_context * ctx, int32_t window, bool queries_only, bool rows,
        void (*cb)(void *, const llama_entrokv_scores *), void * user_data) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    if (window < 0) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "window must be >= 0, got %d", window);
    }
    if (window > (int32_t) ctx->cparams.n_ubatch) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG,
                "window %d is larger than n_ubatch %u: no ubatch could hold it", window, ctx->cparams.n_ubatch);
    }
    {
        std::lock_guard<std::mutex> lock(g_obs_mutex);
        auto & st = g_obs[ctx];
        if (!st) {
            st = std::make_unique<entrokv_observer_state>();
        }
        st->window    = window;
        st->cb        = cb;
        st->user_data = user_data;
    }
    const uint32_t value = (uint32_t) window | (queries_only && window > 0 ? ENTROKV_QUERIES_ONLY : 0u) |
            (queries_only && rows && window > 0 ? ENTROKV_ROWS : 0u);
    if (ctx->cparams.entrokv_window != value) {
        ctx->cparams.entrokv_window = value;
        // a different graph topology: no reuse (graph params compare the window) and a new reservation
        ctx->sched_need_reserve = true;
    }
    return llama_entrokv_ok();
}

int32_t llama_entrokv_access::last_scores(llama_context * ctx, const llama_entrokv_scores ** out) {
    if (ctx == nullptr || out == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "ctx or out is NULL");
    }
    entrokv_observer_state * st = find_state(ctx);
    if (st == nullptr || !st->have) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "nothing observed yet: set an observer window and decode a ubatch of >= window tokens");
    }
    *out = &st->view;
    return llama_entrokv_ok();
}

void llama_entrokv_access::after_ubatch(llama_context & lctx, const llm_graph_result * res, const llama_ubatch & ubatch) {
    if (res == nullptr || res->t_entrokv.empty()) {
        return;
    }
    entrokv_observer_state * st = find_state(&lctx);
    entrokv_target t;
    if (st == nullptr || resolve(&lctx, t) != LLAMA_ENTROKV_OK) {
        return;
    }
    const llama_kv_cache & kv = *t.kv;
    // the outputs of each observed layer: its scores (unless only the queries are observed), its attention
    // rows (the decode observer), then its queries
    std::vector<ggml_tensor *> ts, tq, tr;
    std::vector<int32_t> il_s, il_q, il_r;
    for (size_t i = 0; i < res->t_entrokv.size(); ++i) {
        ggml_tensor * x = res->t_entrokv[i];
        const bool is_q = strncmp(x->name, ENTROKV_Q_PREFIX, strlen(ENTROKV_Q_PREFIX)) == 0;
        const bool is_r = strncmp(x->name, ENTROKV_ROWS_PREFIX, strlen(ENTROKV_ROWS_PREFIX)) == 0;
        (is_q ? tq : is_r ? tr : ts).push_back(x);
        (is_q ? il_q : is_r ? il_r : il_s).push_back(res->t_entrokv_il[i]);
    }
    const bool    q_only   = ts.empty();
    st->layer_ids          = q_only ? il_q : il_s;
    const int32_t n_layers = (int32_t) st->layer_ids.size();
    const int64_t n_kv     = q_only ? 0 : ts[0]->ne[0];
    const int64_t n_head   = q_only ? tq[0]->ne[1] : ts[0]->ne[1];
    const int32_t ns       = n_slots(kv);
    // queries only when every layer has them with one head size
    int64_t hd = tq.size() == (size_t) n_layers ? tq[0]->ne[0] : 0;
    for (ggml_tensor * x : tq) {
        if (x->ne[0] != hd || x->ne[1] != n_head) {
            hd = 0;
        }
    }
    const int64_t w = (int64_t) (lctx.cparams.entrokv_window & ~ENTROKV_FLAGS);
    // the attention rows when every observed layer has them, over one number of cells
    int64_t n_rows = il_r == st->layer_ids && !tr.empty() ? tr[0]->ne[0] : 0;
    for (ggml_tensor * x : tr) {
        if (x->ne[0] != n_rows || x->ne[2] != n_head) {
            n_rows = 0;
        }
    }

    auto get = [&](ggml_tensor * x, float * dst) {
        ggml_backend_t be = ggml_backend_sched_get_tensor_backend(lctx.sched.get(), x);
        if (be) {
            ggml_backend_tensor_get_async(be, x, dst, 0, ggml_nbytes(x));
        } else {
            ggml_backend_tensor_get(x, dst, 0, ggml_nbytes(x));
        }
    };
    st->scores.resize((size_t) n_layers * n_head * n_kv);
    for (int32_t i = 0; !q_only && i < n_layers; ++i) {
        GGML_ASSERT(ts[i]->ne[0] == n_kv && ts[i]->ne[1] == n_head);
        get(ts[i], st->scores.data() + (size_t) i * n_head * n_kv);
    }
    st->queries.resize(hd > 0 ? (size_t) n_layers * w * n_head * hd : 0);
    for (int32_t i = 0; hd > 0 && i < n_layers; ++i) {
        GGML_ASSERT(ggml_nelements(tq[i]) == w * n_head * hd);
        get(tq[i], st->queries.data() + (size_t) i * w * n_head * hd);
    }
    st->rows.resize((size_t) n_layers * n_head * n_rows);
    for (int32_t i = 0; n_rows > 0 && i < n_layers; ++i) {     // [n_kv, 1, n_head], contiguous
        get(tr[i], st->rows.data() + (size_t) i * n_head * n_rows);
    }
    ggml_backend_sched_synchronize(lctx.sched.get());

    st->true_pos.resize((size_t) ns * n_kv);
    fill_true_pos(kv, st->true_pos.data(), (uint32_t) n_kv);

    llama_entrokv_scores & v = st->view;
    v.n_layers  = n_layers;
    v.n_head    = (int32_t) n_head;
    v.n_head_kv = n_layers > 0 ? ns / n_layers : 0;
    v.n_kv      = (int32_t) n_kv;
    v.n_slots   = ns;
    v.window    = (int32_t) w;
    v.n_tokens  = (int32_t) ubatch.n_tokens;
    v.pos_last  = ubatch.pos ? ubatch.pos[ubatch.n_tokens - 1] : -1;
    v.layer_ids = st->layer_ids.data();
    v.scores    = q_only ? nullptr : st->scores.data();
    v.true_pos  = q_only ? nullptr : st->true_pos.data();
    v.head_dim  = (int32_t) hd;
    v.queries   = hd > 0 ? st->queries.data() : nullptr;
    v.n_rows    = (int32_t) n_rows;
    v.rows      = n_rows > 0 ? st->rows.data() : nullptr;
    st->have    = true;

    if (st->cb) {
        st->cb(st->user_data, &v);
    }
}

extern "C" {

int32_t llama_entrokv_set_observer(llama_context * ctx, int32_t window, llama_entrokv_observer cb, void * user_data) {
    return llama_entrokv_access::set_observer(ctx, window, false, false, cb, user_data);
}

int32_t llama_entrokv_set_query_observer(llama_context * ctx, int32_t window, llama_entrokv_observer cb, void * user_data) {
    return llama_entrokv_access::set_observer(ctx, window, true, false, cb, user_data);
}

int32_t llama_entrokv_set_decode_observer(llama_context * ctx, llama_entrokv_observer cb, void * user_data) {
    return llama_entrokv_access::set_observer(ctx, cb != nullptr ? 1 : 0, true, true, cb, user_data);
}

int32_t llama_entrokv_last_scores(llama_context * ctx, const llama_entrokv_scores ** out) {
    return llama_entrokv_access::last_scores(ctx, out);
}

} // extern "C"
