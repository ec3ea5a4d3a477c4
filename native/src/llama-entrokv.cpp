// EntroKV Edge: geometry and per-(layer, KV head) compaction of llama.cpp's KV cache.
// See native/include/llama-entrokv.h for the contract and
// ../shared/design/llama-cpp-notes.md for the llama.cpp facts this relies on.

#include "llama-entrokv.h"
#include "llama-entrokv-impl.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

#include <algorithm>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

static thread_local std::string g_last_error;

static int32_t fail(int32_t code, const char * fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    g_last_error = buf;
    return code;
}

static int32_t ok() {
    g_last_error.clear();
    return LLAMA_ENTROKV_OK;
}

//
// hooks called by the patched llama_kv_cache
//

void llama_entrokv_access::on_clear(llama_kv_cache & kv) {
    if (kv.entrokv) {
        kv.entrokv->reset_compaction();
    }
}

void llama_entrokv_access::on_state_read(llama_kv_cache & kv, llama_seq_id seq_id) {
    GGML_UNUSED(seq_id);
    // the restored cells replace the compacted ones; their true positions are the
    // caller's to restore (the Python runtime saves them beside the state)
    if (kv.entrokv) {
        kv.entrokv->reset_compaction();
    }
}

// true if range [p0, p1) (llama.cpp conventions: negative = open) touches the compacted cells
static bool touches_compacted(const llama_entrokv_state & st, llama_pos p0, llama_pos p1) {
    const llama_pos a = p0 < 0 ? 0 : p0;
    const llama_pos b = p1 < 0 ? std::numeric_limits<llama_pos>::max() : p1;
    return a < b && b > st.pos_lo && a <= st.pos_hi;
}

bool llama_entrokv_access::allow_seq_rm(llama_kv_cache & kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    auto & st = kv.entrokv;
    if (!st || !st->compacted() || !touches_compacted(*st, p0, p1)) {
        return true;
    }
    const bool whole = p0 <= 0 && p1 < 0;
    if (whole) {
        // the compacted cells leave with the sequence; keep the table only if another
        // sequence still holds them
        bool shared = false;
        const auto & cells = kv.v_cells[0];
        for (uint32_t c = 0; c < st->n_keep && c < cells.size(); ++c) {
            if (!cells.is_empty(c) && cells.seq_count(c) > ((seq_id >= 0 && cells.seq_has(c, seq_id)) ? 1 : 0)) {
                shared = true;
                break;
            }
        }
        if (!shared || seq_id < 0) {
            st->reset_compaction();
        }
        return true;
    }
    st->n_refused++;
    LLAMA_LOG_WARN("%s: entrokv: refusing seq_rm(seq %d, [%d, %d)): it would remove some of the compacted "
            "cells (positions %d..%d), whose tokens differ per KV head; remove the whole sequence instead\n",
            __func__, seq_id, p0, p1, st->pos_lo, st->pos_hi);
    return false;
}

bool llama_entrokv_access::allow_seq_shift(llama_kv_cache & kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1, const char * op) {
    auto & st = kv.entrokv;
    if (!st || !st->compacted() || !touches_compacted(*st, p0, p1)) {
        return true;
    }
    st->n_refused++;
    LLAMA_LOG_ERROR("%s: entrokv: refusing %s(seq %d, [%d, %d)) over compacted cells (positions %d..%d): "
            "their positions are synthetic, a shift would move the wrong tokens per KV head\n",
            __func__, op, seq_id, p0, p1, st->pos_lo, st->pos_hi);
    return false;
}

//
// resolving a context to the cache we act on
//

struct entrokv_target {
    llama_kv_cache * kv   = nullptr;
    bool             iswa = false;
};

int32_t llama_entrokv_access::resolve(llama_context * ctx, entrokv_target & t) {
    if (ctx == nullptr) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "ctx is NULL");
    }
    llama_memory_i * mem = ctx->get_memory();
    if (mem == nullptr) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "the context has no KV cache");
    }
    if (typeid(*mem) == typeid(llama_kv_cache)) {
        t.kv = static_cast<llama_kv_cache *>(mem);
    } else if (typeid(*mem) == typeid(llama_kv_cache_iswa)) {
        t.kv   = static_cast<llama_kv_cache_iswa *>(mem)->get_base();
        t.iswa = true;
    } else {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED,
                "unsupported memory (recurrent, hybrid or a specialised cache); only plain and iswa KV caches can be compacted");
    }
    const llama_kv_cache & kv = *t.kv;
    const llama_hparams & hp = kv.hparams;
    if (kv.other != nullptr || hp.n_layer_kv_from_start >= 0) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported cache: it shares or reuses another cache's layers");
    }
    if (kv.swa_type != LLAMA_SWA_TYPE_NONE) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported cache: a sliding-window (SWA) cache cannot be compacted");
    }
    if (hp.n_pos_per_embd() > 1) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported model: M-RoPE (several positions per token)");
    }
    if (hp.use_alibi) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported model: ALiBi position bias");
    }
    if (hp.is_mla()) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported model: multi-head latent attention (MLA)");
    }
    if (hp.n_rel_attn_bkts > 0) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported model: relative position buckets");
    }
    if (kv.get_n_stream() != 1) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported cache: %u streams (use a unified KV cache or n_seq_max = 1)", kv.get_n_stream());
    }
    if (kv.layers.empty()) {
        return fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "the cache has no layers");
    }
    return LLAMA_ENTROKV_OK;
}

static bool tensor_on_host(const ggml_tensor * t) {
    return t->buffer != nullptr && ggml_backend_buffer_is_host(t->buffer);
}

int32_t llama_entrokv_access::n_slots(const llama_kv_cache & kv) {
    int32_t n = 0;
    for (const auto & l : kv.layers) {
        n += (int32_t) kv.hparams.n_head_kv(l.il);
    }
    return n;
}

int32_t llama_entrokv_access::geometry(llama_context * ctx, llama_entrokv_geometry & g) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    const llama_kv_cache & kv = *t.kv;
    const auto & cells = kv.v_cells[0];
    const auto & st = kv.entrokv;

    g = {};
    g.n_layers      = (int32_t) kv.layers.size();
    g.n_slots       = n_slots(kv);
    g.kv_size       = kv.get_size();
    g.n_used        = cells.get_used();
    g.v_trans       = kv.v_trans ? 1 : 0;
    g.is_iswa       = t.iswa ? 1 : 0;
    g.type_k        = (int32_t) kv.type_k();
    g.type_v        = (int32_t) kv.type_v();
    g.n_compacted   = st ? (int32_t) st->n_keep : 0;
    g.n_compactions = st ? st->n_compactions : 0;
    g.pos_max       = cells.seq_pos_max(0);
    g.host_buffers  = 1;
    for (const auto & l : kv.layers) {
        if (!tensor_on_host(l.k) || !tensor_on_host(l.v)) {
            g.host_buffers = 0;
        }
    }
    return ok();
}

int32_t llama_entrokv_access::layer(llama_context * ctx, int32_t i, llama_entrokv_layer & out) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    const llama_kv_cache & kv = *t.kv;
    if (i < 0 || (size_t) i >= kv.layers.size()) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "layer index %d out of range 0..%d", i, (int) kv.layers.size() - 1);
    }
    int32_t slot0 = 0;
    for (int32_t j = 0; j < i; ++j) {
        slot0 += (int32_t) kv.hparams.n_head_kv(kv.layers[j].il);
    }
    const auto & l = kv.layers[i];
    out = {};
    out.il               = (int32_t) l.il;
    out.n_head_kv        = (int32_t) kv.hparams.n_head_kv(l.il);
    out.head_dim_k       = (int32_t) kv.hparams.n_embd_head_k(l.il);
    out.head_dim_v       = (int32_t) kv.hparams.n_embd_head_v(l.il);
    out.slot0            = slot0;
    out.on_host          = tensor_on_host(l.k) && tensor_on_host(l.v) ? 1 : 0;
    out.k_bytes_per_cell = ggml_row_size(l.k->type, kv.hparams.n_embd_k_gqa(l.il));
    out.v_bytes_per_cell = ggml_row_size(l.v->type, kv.hparams.n_embd_v_gqa(l.il));
    return ok();
}

// true position of the token in cell c for slot s, -1 if the cell is empty
static llama_pos true_pos_of(const llama_entrokv_state * st, const llama_kv_cells & cells, int32_t s, uint32_t c) {
    if (cells.is_empty(c)) {
        return -1;
    }
    const llama_pos p = cells.pos_get(c);
    // a compacted cell still carries its synthetic position pos_lo + c; anything else was written since
    if (st && st->compacted() && c < st->n_keep && p == st->pos_lo + (llama_pos) c) {
        return st->true_pos[(size_t) s * st->n_keep + c];
    }
    return p;
}

int32_t llama_entrokv_access::true_pos(llama_context * ctx, int32_t * out, size_t n_out) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    const llama_kv_cache & kv = *t.kv;
    const int32_t ns = n_slots(kv);
    const uint32_t kv_size = kv.get_size();
    if (out == nullptr) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "out is NULL");
    }
    if (n_out < (size_t) ns * kv_size) {
        return fail(LLAMA_ENTROKV_ERR_BUFFER_SIZE, "out holds %zu values, need n_slots * kv_size = %zu", n_out, (size_t) ns * kv_size);
    }
    const auto & cells = kv.v_cells[0];
    const llama_entrokv_state * st = kv.entrokv.get();
    for (int32_t s = 0; s < ns; ++s) {
        for (uint32_t c = 0; c < kv_size; ++c) {
            out[(size_t) s * kv_size + c] = true_pos_of(st, cells, s, c);
        }
    }
    return ok();
}

//
// data movement
//

// host fast path: in-place gather. Ascending lists need no scratch (a source cell is never
// below its destination); unordered lists are gathered through a scratch copy per head.
static void gather_rows_unordered(char * base, size_t row, size_t off, size_t n, int32_t K, const int32_t * src,
        std::vector<char> & tmp) {
    tmp.resize((size_t) K * n);
    for (int32_t j = 0; j < K; ++j) {
        memcpy(tmp.data() + (size_t) j * n, base + (size_t) src[j] * row + off, n);
    }
    for (int32_t j = 0; j < K; ++j) {
        memcpy(base + (size_t) j * row + off, tmp.data() + (size_t) j * n, n);
    }
}

static void gather_host(ggml_tensor * k, ggml_tensor * v, bool v_trans, uint32_t kv_size,
        int32_t n_head, int32_t hd_k, int32_t hd_v, int32_t K, const int32_t * keep /* [n_head][K] */, bool unordered) {
    if (unordered) {
        std::vector<char> tmp;
        const size_t k_head = ggml_row_size(k->type, hd_k);
        for (int32_t h = 0; h < n_head; ++h) {
            const int32_t * src = keep + (size_t) h * K;
            gather_rows_unordered((char *) k->data, k->nb[1], h * k_head, k_head, K, src, tmp);
            if (!v_trans) {
                const size_t v_head = ggml_row_size(v->type, hd_v);
                gather_rows_unordered((char *) v->data, v->nb[1], h * v_head, v_head, K, src, tmp);
            } else {
                const size_t es = ggml_type_size(v->type);
                for (int32_t d = 0; d < hd_v; ++d) {
                    char * row = (char *) v->data + ((size_t) (h * hd_v + d) * kv_size) * es;
                    gather_rows_unordered(row, es, 0, es, K, src, tmp);
                }
            }
        }
        return;
    }
    char * kb = (char *) k->data;
    const size_t k_row  = k->nb[1];
    const size_t k_head = ggml_row_size(k->type, hd_k);
    char * vb = (char *) v->data;
    for (int32_t h = 0; h < n_head; ++h) {
        const int32_t * src = keep + (size_t) h * K;
        for (int32_t j = 0; j < K; ++j) {
            if (src[j] != j) {
                memcpy(kb + (size_t) j * k_row + h * k_head, kb + (size_t) src[j] * k_row + h * k_head, k_head);
            }
        }
        if (!v_trans) {
            const size_t v_row  = v->nb[1];
            const size_t v_head = ggml_row_size(v->type, hd_v);
            for (int32_t j = 0; j < K; ++j) {
                if (src[j] != j) {
                    memcpy(vb + (size_t) j * v_row + h * v_head, vb + (size_t) src[j] * v_row + h * v_head, v_head);
                }
            }
        } else {
            // channel (h, d) of V is one contiguous row of kv_size elements
            const size_t es = ggml_type_size(v->type);
            for (int32_t d = 0; d < hd_v; ++d) {
                char * row = vb + ((size_t) (h * hd_v + d) * kv_size) * es;
                if (es == 2) {
                    uint16_t * r = (uint16_t *) row;
                    for (int32_t j = 0; j < K; ++j) { r[j] = r[src[j]]; }
                } else if (es == 4) {
                    uint32_t * r = (uint32_t *) row;
                    for (int32_t j = 0; j < K; ++j) { r[j] = r[src[j]]; }
                } else {
                    for (int32_t j = 0; j < K; ++j) { memmove(row + j * es, row + (size_t) src[j] * es, es); }
                }
            }
        }
    }
}

// backend-agnostic path: one small ggml graph per layer, run on the device that holds the layer
struct entrokv_layer_graph {
    ggml_context * ctx = nullptr;
    ggml_cgraph  * gf  = nullptr;
    ggml_tensor  * src_idx = nullptr; // I32 [K, n_head]
    ggml_tensor  * dst_idx = nullptr; // I64 [K, 1]
    ggml_backend_t backend = nullptr;
    std::vector<int32_t> src;
    ~entrokv_layer_graph() { if (ctx) { ggml_free(ctx); } }
};

static ggml_tensor * build_gather(ggml_context * ctx, ggml_tensor * t, int32_t hd, int32_t n_head, uint32_t kv_size,
        ggml_tensor * src_idx, ggml_tensor * dst_idx) {
    ggml_tensor * view = ggml_view_3d(ctx, t, hd, kv_size, n_head, t->nb[1], ggml_row_size(t->type, hd), 0);
    ggml_tensor * rows = ggml_get_rows(ctx, view, src_idx);   // [hd, K, n_head] F32
    return ggml_set_rows(ctx, view, rows, dst_idx);
}

static ggml_tensor * build_gather_vtrans(ggml_context * ctx, ggml_tensor * v, int32_t hd, int32_t n_head, uint32_t kv_size,
        int32_t K, ggml_tensor * src_idx) {
    const size_t es = ggml_type_size(v->type);
    // [kv_size, hd, n_head]: channel rows of kv_size elements
    ggml_tensor * vt   = ggml_view_3d(ctx, v, kv_size, hd, n_head, kv_size * es, (size_t) hd * kv_size * es, 0);
    ggml_tensor * rows = ggml_cont(ctx, ggml_transpose(ctx, vt));              // [hd, kv_size, n_head]
    ggml_tensor * g    = ggml_get_rows(ctx, rows, src_idx);                     // [hd, K, n_head] F32
    ggml_tensor * gt   = ggml_cont(ctx, ggml_transpose(ctx, g));                // [K, hd, n_head] F32
    ggml_tensor * dst  = ggml_view_3d(ctx, v, K, hd, n_head, kv_size * es, (size_t) hd * kv_size * es, 0);
    return ggml_cpy(ctx, gt, dst);
}

int32_t llama_entrokv_access::compact(llama_context * ctx, llama_seq_id seq_id, int32_t n_slots_in,
        const int32_t * lens, const int32_t * cells_in, uint32_t flags) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    llama_kv_cache & kv = *t.kv;
    auto & cells = kv.v_cells[0];
    const uint32_t kv_size = kv.get_size();
    const int32_t ns = n_slots(kv);

    if ((flags & ~(uint32_t) (LLAMA_ENTROKV_COMPACT_GRAPH | LLAMA_ENTROKV_COMPACT_UNORDERED)) != 0) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "unknown flags 0x%x", flags);
    }
    if (lens == nullptr || cells_in == nullptr) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "lens or cells is NULL");
    }
    if (n_slots_in != ns) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "got %d keep lists, the cache has %d (layer, KV head) slots", n_slots_in, ns);
    }
    if (seq_id < 0 || seq_id >= LLAMA_MAX_SEQ) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "invalid sequence id %d", seq_id);
    }

    // the cache must hold exactly one sequence, seq_id, and no pending shift
    uint32_t n_seq_cells = 0;
    for (uint32_t c = 0; c < cells.size(); ++c) {
        if (cells.is_empty(c)) {
            continue;
        }
        if (cells.seq_count(c) != 1 || !cells.seq_has(c, seq_id)) {
            return fail(LLAMA_ENTROKV_ERR_MULTI_SEQ, "cell %u belongs to another sequence or to several: "
                    "compaction needs sequence %d to be the only one in the cache", c, seq_id);
        }
        n_seq_cells++;
    }
    if (n_seq_cells == 0) {
        return fail(LLAMA_ENTROKV_ERR_EMPTY_SEQ, "sequence %d holds no token", seq_id);
    }
    if (cells.get_has_shift()) {
        return fail(LLAMA_ENTROKV_ERR_PENDING_SHIFT, "a K-shift is pending: decode once (or call llama_memory_update) before compacting");
    }

    // the keep lists
    const int32_t K = lens[0];
    for (int32_t s = 0; s < ns; ++s) {
        if (lens[s] != K) {
            return fail(LLAMA_ENTROKV_ERR_LIST_LENGTH, "keep lists have unequal lengths (slot 0: %d, slot %d: %d); "
                    "every (layer, KV head) must keep the same number of cells", K, s, lens[s]);
        }
    }
    if (K < 1 || (uint32_t) K > n_seq_cells) {
        return fail(LLAMA_ENTROKV_ERR_LIST_LENGTH, "keep length %d outside 1..%u (the cells of the sequence)", K, n_seq_cells);
    }
    const llama_pos pmax = cells.seq_pos_max(seq_id);
    if (pmax - K + 1 < 0) {
        return fail(LLAMA_ENTROKV_ERR_LIST_LENGTH, "keep length %d exceeds the positions of the sequence (max %d)", K, pmax);
    }
    const bool unordered = (flags & LLAMA_ENTROKV_COMPACT_UNORDERED) != 0;
    std::vector<int32_t> seen(unordered ? kv_size : 0, -1);
    for (int32_t s = 0; s < ns; ++s) {
        const int32_t * l = cells_in + (size_t) s * K;
        for (int32_t j = 0; j < K; ++j) {
            if (l[j] < 0 || (uint32_t) l[j] >= kv_size) {
                return fail(LLAMA_ENTROKV_ERR_CELL_RANGE, "slot %d: cell %d outside 0..%u", s, l[j], kv_size - 1);
            }
            if (unordered) {
                if (seen[l[j]] == s) {
                    return fail(LLAMA_ENTROKV_ERR_CELL_ORDER, "slot %d: cell %d listed twice", s, l[j]);
                }
                seen[l[j]] = s;
            } else if (j > 0 && l[j] <= l[j - 1]) {
                return fail(LLAMA_ENTROKV_ERR_CELL_ORDER, "slot %d: cells must be strictly ascending (%d then %d at index %d)",
                        s, l[j - 1], l[j], j);
            }
            if (cells.is_empty(l[j]) || !cells.seq_has(l[j], seq_id)) {
                return fail(LLAMA_ENTROKV_ERR_CELL_NOT_IN_SEQ, "slot %d: cell %d holds no token of sequence %d", s, l[j], seq_id);
            }
        }
    }

    // the true positions after the compaction, composed with any earlier one
    const llama_entrokv_state * st_old = kv.entrokv.get();
    std::vector<int32_t> tpos((size_t) ns * K);
    for (int32_t s = 0; s < ns; ++s) {
        for (int32_t j = 0; j < K; ++j) {
            tpos[(size_t) s * K + j] = true_pos_of(st_old, cells, s, (uint32_t) cells_in[(size_t) s * K + j]);
        }
    }

    // move the data
    const bool force_graph = (flags & LLAMA_ENTROKV_COMPACT_GRAPH) != 0;
    llama_synchronize(ctx);

    std::vector<std::unique_ptr<entrokv_layer_graph>> graphs;
    std::map<ggml_backend_dev_t, ggml_backend_t> backends;
    auto release = [&]() {
        graphs.clear();
        for (auto & [_, be] : backends) {
            ggml_backend_free(be);
        }
        backends.clear();
    };

    // plan every layer first, so that an unsupported backend is found before anything moves
    for (size_t il = 0, slot0 = 0; il < kv.layers.size(); ++il) {
        const auto & l = kv.layers[il];
        const int32_t n_head = (int32_t) kv.hparams.n_head_kv(l.il);
        const bool host = tensor_on_host(l.k) && tensor_on_host(l.v);
        if (host && !force_graph) {
            graphs.emplace_back(nullptr);
            slot0 += n_head;
            continue;
        }
        auto g = std::make_unique<entrokv_layer_graph>();
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(l.k->buffer));
        if (dev == nullptr && host) {
            // plain host buffers (ggml_backend_cpu_buffer_type) carry no device: run on the CPU
            dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        }
        if (dev == nullptr) {
            release();
            return fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: the KV buffer has no device", l.il);
        }
        if (!backends.count(dev)) {
            ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
            if (be == nullptr) {
                release();
                return fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: cannot start a backend on device %s", l.il, ggml_backend_dev_name(dev));
            }
            backends[dev] = be;
        }
        g->backend = backends[dev];
        ggml_init_params ip = {
            /*.mem_size   =*/ ggml_tensor_overhead() * 32 + ggml_graph_overhead_custom(32, false),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        g->ctx = ggml_init(ip);
        g->gf  = ggml_new_graph_custom(g->ctx, 32, false);
        g->src_idx = ggml_new_tensor_2d(g->ctx, GGML_TYPE_I32, K, n_head);
        g->dst_idx = ggml_new_tensor_2d(g->ctx, GGML_TYPE_I64, K, 1);
        ggml_set_input(g->src_idx);
        ggml_set_input(g->dst_idx);
        const int32_t hd_k = (int32_t) kv.hparams.n_embd_head_k(l.il);
        const int32_t hd_v = (int32_t) kv.hparams.n_embd_head_v(l.il);
        ggml_build_forward_expand(g->gf, build_gather(g->ctx, l.k, hd_k, n_head, kv_size, g->src_idx, g->dst_idx));
        if (kv.v_trans) {
            ggml_build_forward_expand(g->gf, build_gather_vtrans(g->ctx, l.v, hd_v, n_head, kv_size, K, g->src_idx));
        } else {
            ggml_build_forward_expand(g->gf, build_gather(g->ctx, l.v, hd_v, n_head, kv_size, g->src_idx, g->dst_idx));
        }
        for (int i = 0; i < ggml_graph_n_nodes(g->gf); ++i) {
            ggml_tensor * node = ggml_graph_node(g->gf, i);
            if (!ggml_backend_supports_op(g->backend, node)) {
                const std::string msg = std::string(ggml_op_desc(node)) + " on " + ggml_backend_name(g->backend);
                release();
                return fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: the backend does not support %s", l.il, msg.c_str());
            }
        }
        g->src.assign(cells_in + slot0 * K, cells_in + (slot0 + n_head) * K);
        graphs.push_back(std::move(g));
        slot0 += n_head;
    }

    std::vector<int64_t> dst(K);
    for (int32_t j = 0; j < K; ++j) {
        dst[j] = j;
    }
    std::map<ggml_backend_t, ggml_gallocr_t> allocs;
    int32_t rc = LLAMA_ENTROKV_OK;
    for (size_t il = 0, slot0 = 0; il < kv.layers.size(); ++il) {
        const auto & l = kv.layers[il];
        const int32_t n_head = (int32_t) kv.hparams.n_head_kv(l.il);
        auto & g = graphs[il];
        if (!g) {
            gather_host(l.k, l.v, kv.v_trans, kv_size, n_head,
                    (int32_t) kv.hparams.n_embd_head_k(l.il), (int32_t) kv.hparams.n_embd_head_v(l.il), K,
                    cells_in + slot0 * K, unordered);
            slot0 += n_head;
            continue;
        }
        slot0 += n_head;
        if (!allocs.count(g->backend)) {
            allocs[g->backend] = ggml_gallocr_new(ggml_backend_get_default_buffer_type(g->backend));
        }
        if (!ggml_gallocr_alloc_graph(allocs[g->backend], g->gf)) {
            rc = fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: cannot allocate the compaction graph (the cache is now partly compacted)", l.il);
            break;
        }
        ggml_backend_tensor_set(g->src_idx, g->src.data(), 0, ggml_nbytes(g->src_idx));
        ggml_backend_tensor_set(g->dst_idx, dst.data(), 0, ggml_nbytes(g->dst_idx));
        if (ggml_backend_graph_compute(g->backend, g->gf) != GGML_STATUS_SUCCESS) {
            rc = fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: the compaction graph failed (the cache is now partly compacted)", l.il);
            break;
        }
    }
    for (auto & [_, a] : allocs) {
        ggml_gallocr_free(a);
    }
    release();
    if (rc != LLAMA_ENTROKV_OK) {
        return rc;
    }

    // the cells: 0..K-1 hold the sequence at positions pmax-K+1 .. pmax, everything else is free
    for (uint32_t c = 0; c < cells.size(); ++c) {
        if (!cells.is_empty(c)) {
            cells.rm(c);
        }
    }
    const llama_pos p_lo = pmax - K + 1;
    for (int32_t j = 0; j < K; ++j) {
        cells.pos_set((uint32_t) j, p_lo + j);
        cells.seq_add((uint32_t) j, seq_id);
    }
    kv.v_heads[0] = (uint32_t) K % kv_size;

    if (!kv.entrokv) {
        kv.entrokv = std::make_shared<llama_entrokv_state>();
    }
    auto & st = *kv.entrokv;
    st.n_keep   = (uint32_t) K;
    st.pos_lo   = p_lo;
    st.pos_hi   = pmax;
    st.n_slots  = ns;
    st.true_pos = std::move(tpos);
    st.n_compactions++;
    return ok();
}

int32_t llama_entrokv_access::n_refused(llama_context * ctx) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    ok();
    return t.kv->entrokv ? t.kv->entrokv->n_refused : 0;
}

//
// public C API
//

extern "C" {

const char * llama_entrokv_last_error(void) {
    return g_last_error.c_str();
}

int32_t llama_entrokv_api_version(void) {
    return LLAMA_ENTROKV_API_VERSION;
}

int32_t llama_entrokv_get_geometry(llama_context * ctx, llama_entrokv_geometry * out) {
    if (out == nullptr) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "out is NULL");
    }
    return llama_entrokv_access::geometry(ctx, *out);
}

int32_t llama_entrokv_get_layer(llama_context * ctx, int32_t il_index, llama_entrokv_layer * out) {
    if (out == nullptr) {
        return fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "out is NULL");
    }
    return llama_entrokv_access::layer(ctx, il_index, *out);
}

int32_t llama_entrokv_true_pos(llama_context * ctx, int32_t * out, size_t n_out) {
    return llama_entrokv_access::true_pos(ctx, out, n_out);
}

int32_t llama_entrokv_compact(llama_context * ctx, llama_seq_id seq_id, int32_t n_slots,
        const int32_t * lens, const int32_t * cells, uint32_t flags) {
    try {
        return llama_entrokv_access::compact(ctx, seq_id, n_slots, lens, cells, flags);
    } catch (const std::exception & e) {
        return fail(LLAMA_ENTROKV_ERR_BACKEND, "compaction failed: %s", e.what());
    }
}

int32_t llama_entrokv_n_refused(llama_context * ctx) {
    return llama_entrokv_access::n_refused(ctx);
}

} // extern "C"
