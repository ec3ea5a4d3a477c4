// EntroKV Edge: geometry and per-(layer, KV head) compaction of llama.cpp's KV cache.
// See native/include/llama-entrokv.h for the contract and
// docs/development.md ("The llama.cpp internals our native code relies on") for the
// llama.cpp facts this relies on.

#include "llama-entrokv.h"
#include "llama-entrokv-impl.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-model.h"
#include "llama-vocab.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

static thread_local std::string g_last_error;

int32_t llama_entrokv_fail(int32_t code, const char * fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    g_last_error = buf;
    return code;
}

int32_t llama_entrokv_ok() {
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
    LLAMA_LOG_INFO("%s: entrokv: refusing seq_rm(seq %d, [%d, %d)): it would remove some of the compacted "
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

int32_t llama_entrokv_access::resolve(llama_context * ctx, entrokv_target & t) {
    if (ctx == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "ctx is NULL");
    }
    llama_memory_i * mem = ctx->get_memory();
    if (mem == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "the context has no KV cache");
    }
    if (typeid(*mem) == typeid(llama_kv_cache)) {
        t.kv = static_cast<llama_kv_cache *>(mem);
    } else if (typeid(*mem) == typeid(llama_kv_cache_iswa)) {
        t.kv   = static_cast<llama_kv_cache_iswa *>(mem)->get_base();
        t.iswa = true;
    } else {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED,
                "unsupported memory (recurrent, hybrid or a specialised cache); only plain and iswa KV caches can be compacted");
    }
    const llama_kv_cache & kv = *t.kv;
    const llama_hparams & hp = kv.hparams;
    if (kv.other != nullptr || hp.n_layer_kv_from_start >= 0) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported cache: it shares or reuses another cache's layers");
    }
    if (kv.swa_type != LLAMA_SWA_TYPE_NONE) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported cache: a sliding-window (SWA) cache cannot be compacted");
    }
    if (hp.n_pos_per_embd() > 1) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported model: M-RoPE (several positions per token)");
    }
    if (hp.use_alibi) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported model: ALiBi position bias");
    }
    if (hp.is_mla()) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported model: multi-head latent attention (MLA)");
    }
    if (hp.n_rel_attn_bkts > 0) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported model: relative position buckets");
    }
    if (kv.get_n_stream() != 1) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported cache: %u streams (use a unified KV cache or n_seq_max = 1)", kv.get_n_stream());
    }
    if (kv.layers.empty()) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "the cache has no layers");
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
    return llama_entrokv_ok();
}

int32_t llama_entrokv_access::layer(llama_context * ctx, int32_t i, llama_entrokv_layer & out) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    const llama_kv_cache & kv = *t.kv;
    if (i < 0 || (size_t) i >= kv.layers.size()) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "layer index %d out of range 0..%d", i, (int) kv.layers.size() - 1);
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
    return llama_entrokv_ok();
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

void llama_entrokv_access::fill_true_pos(const llama_kv_cache & kv, int32_t * out, uint32_t n_cols) {
    const int32_t ns = n_slots(kv);
    const auto & cells = kv.v_cells[0];
    const llama_entrokv_state * st = kv.entrokv.get();
    for (int32_t s = 0; s < ns; ++s) {
        for (uint32_t c = 0; c < n_cols; ++c) {
            out[(size_t) s * n_cols + c] = true_pos_of(st, cells, s, c);
        }
    }
}

// the checks of an API call that fills out[n_slots][kv_size]: resolve the cache, out non-NULL and large enough
static int32_t resolve_slot_table(llama_context * ctx, entrokv_target & t, const void * out, size_t n_out) {
    if (int32_t rc = llama_entrokv_access::resolve(ctx, t)) {
        return rc;
    }
    const size_t need = (size_t) llama_entrokv_access::n_slots(*t.kv) * t.kv->get_size();
    if (out == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "out is NULL");
    }
    if (n_out < need) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BUFFER_SIZE, "out holds %zu values, need n_slots * kv_size = %zu", n_out, need);
    }
    return LLAMA_ENTROKV_OK;
}

int32_t llama_entrokv_access::true_pos(llama_context * ctx, int32_t * out, size_t n_out) {
    entrokv_target t;
    if (int32_t rc = resolve_slot_table(ctx, t, out, n_out)) {
        return rc;
    }
    fill_true_pos(*t.kv, out, t.kv->get_size());
    return llama_entrokv_ok();
}

// Norm of each cell's value vector per slot. The cells past the last used one are not read.
int32_t llama_entrokv_access::value_norms(llama_context * ctx, float * out, size_t n_out) {
    entrokv_target t;
    if (int32_t rc = resolve_slot_table(ctx, t, out, n_out)) {
        return rc;
    }
    const llama_kv_cache & kv = *t.kv;
    const uint32_t kv_size = kv.get_size();
    for (const auto & l : kv.layers) {
        if (l.v->type != GGML_TYPE_F32 && ggml_get_type_traits(l.v->type)->to_float == nullptr) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "layer %u: V of type %s cannot be converted to float", l.il, ggml_type_name(l.v->type));
        }
        if ((int64_t) kv.hparams.n_embd_head_v(l.il) * kv.hparams.n_head_kv(l.il) != (int64_t) kv.hparams.n_embd_v_gqa(l.il)) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "layer %u: V rows are not n_head_kv x head_dim_v", l.il);
        }
        if (kv.v_trans && ggml_is_quantized(l.v->type)) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "layer %u: transposed V of quantized type %s", l.il, ggml_type_name(l.v->type));
        }
    }
    llama_synchronize(ctx);     // the last decode may still be writing V on an asynchronous backend
    const auto & cells = kv.v_cells[0];
    const uint32_t n_cells = std::min(cells.used_max_p1(), kv_size);
    std::vector<uint8_t> raw;
    std::vector<float>   f;
    // to float: ggml's converter, or a copy for F32 (which has none)
    auto to_float = [](ggml_type type, const void * src, float * dst, int64_t n) {
        if (type == GGML_TYPE_F32) {
            memcpy(dst, src, (size_t) n * sizeof(float));
        } else {
            ggml_get_type_traits(type)->to_float(src, dst, n);
        }
    };
    float * o = out;
    for (const auto & l : kv.layers) {
        const int64_t n_embd = kv.hparams.n_embd_v_gqa(l.il);
        const int32_t nh     = (int32_t) kv.hparams.n_head_kv(l.il);
        const int64_t hd     = kv.hparams.n_embd_head_v(l.il);
        std::fill(o, o + (size_t) nh * kv_size, 0.0f);
        if (n_cells > 0 && !kv.v_trans) {       // row c: the n_embd values of cell c, head after head
            const size_t row = ggml_row_size(l.v->type, n_embd);
            raw.resize(row * n_cells);
            f.resize((size_t) n_embd);
            ggml_backend_tensor_get(l.v, raw.data(), 0, raw.size());
            for (uint32_t c = 0; c < n_cells; ++c) {
                if (cells.is_empty(c)) {
                    continue;
                }
                to_float(l.v->type, raw.data() + (size_t) c * row, f.data(), n_embd);
                for (int32_t h = 0; h < nh; ++h) {
                    double acc = 0.0;
                    for (int64_t j = 0; j < hd; ++j) {
                        acc += (double) f[h * hd + j] * f[h * hd + j];
                    }
                    o[(size_t) h * kv_size + c] = (float) std::sqrt(acc);
                }
            }
        } else if (n_cells > 0) {               // transposed: row j holds channel j of every cell
            // rows in blocks of about 4 MiB, each block one read (one round trip on a remote backend)
            const size_t el    = ggml_type_size(l.v->type);
            const size_t pitch = (size_t) kv_size * el;
            const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(n_embd, (int64_t) ((4u << 20) / pitch)));
            f.resize(n_cells);
            std::vector<double> acc((size_t) nh * n_cells, 0.0);
            for (int64_t j0 = 0; j0 < n_embd; j0 += rows) {
                const int64_t nr = std::min(rows, n_embd - j0);
                raw.resize((size_t) (nr - 1) * pitch + (size_t) n_cells * el);
                ggml_backend_tensor_get(l.v, raw.data(), (size_t) j0 * pitch, raw.size());
                for (int64_t j = j0; j < j0 + nr; ++j) {
                    to_float(l.v->type, raw.data() + (size_t) (j - j0) * pitch, f.data(), n_cells);
                    double * a = acc.data() + (size_t) (j / hd) * n_cells;
                    for (uint32_t c = 0; c < n_cells; ++c) {
                        a[c] += (double) f[c] * f[c];
                    }
                }
            }
            for (int32_t h = 0; h < nh; ++h) {
                for (uint32_t c = 0; c < n_cells; ++c) {
                    o[(size_t) h * kv_size + c] = cells.is_empty(c) ? 0.0f : (float) std::sqrt(acc[(size_t) h * n_cells + c]);
                }
            }
        }
        o += (size_t) nh * kv_size;
    }
    return llama_entrokv_ok();
}

//
// data movement
//

// host fast path: in-place gather. Element j of a strided sequence (one head's slice of
// K or V rows, or one channel row of a transposed V) receives element src[j].
//  - ascending lists need no scratch: a source is never below its destination, so
//    copying in ascending order never reads an element already overwritten;
//    consecutive sources are merged into one memmove when the elements are adjacent
//  - unordered lists go through a scratch copy
struct strided {
    char * base;
    size_t stride; // bytes between elements j and j+1
    size_t n;      // bytes of one element
};

template <size_t N_BYTES>
static void copy_slices(const strided & a, int32_t K, const int32_t * src) {
    for (int32_t j = 0; j < K; ++j) {
        if (src[j] != j) {
            memcpy(a.base + (size_t) j * a.stride, a.base + (size_t) src[j] * a.stride, N_BYTES);
        }
    }
}

static void gather_sorted(const strided & a, int32_t K, const int32_t * src) {
    if (a.stride == a.n) {
        for (int32_t j = 0; j < K; ) {
            int32_t m = 1;
            while (j + m < K && src[j + m] == src[j] + m) {
                ++m;
            }
            if (src[j] != j) {
                memmove(a.base + (size_t) j * a.n, a.base + (size_t) src[j] * a.n, (size_t) m * a.n);
            }
            j += m;
        }
        return;
    }
    // one head's slice of a row: constant sizes let the compiler inline the copy
    switch (a.n) {
        case  64: copy_slices< 64>(a, K, src); break;
        case 128: copy_slices<128>(a, K, src); break;
        case 256: copy_slices<256>(a, K, src); break;
        default:
            for (int32_t j = 0; j < K; ++j) {
                if (src[j] != j) {
                    memcpy(a.base + (size_t) j * a.stride, a.base + (size_t) src[j] * a.stride, a.n);
                }
            }
    }
}

static void gather_unordered(const strided & a, int32_t K, const int32_t * src, std::vector<char> & tmp) {
    tmp.resize((size_t) K * a.n);
    for (int32_t j = 0; j < K; ++j) {
        memcpy(tmp.data() + (size_t) j * a.n, a.base + (size_t) src[j] * a.stride, a.n);
    }
    for (int32_t j = 0; j < K; ++j) {
        memcpy(a.base + (size_t) j * a.stride, tmp.data() + (size_t) j * a.n, a.n);
    }
}

// runs of consecutive sources of one list: (destination, source, length)
struct gather_run {
    int32_t dst;
    int32_t src;
    int32_t len;
};

static void find_runs(int32_t K, const int32_t * src, std::vector<gather_run> & runs) {
    runs.clear();
    for (int32_t j = 0; j < K; ) {
        int32_t m = 1;
        while (j + m < K && src[j + m] == src[j] + m) {
            ++m;
        }
        if (src[j] != j) {
            runs.push_back({ j, src[j], m });
        }
        j += m;
    }
}

// transposed V rows of 2-byte elements (F16/BF16): the same list serves every channel
// of a head, so its runs are found once; lists made of pages become a few memmoves,
// lists of scattered tokens a plain gather loop
static void gather_rows_u16(char * row0, size_t row_bytes, int32_t n_rows, int32_t K, const int32_t * src,
        const std::vector<gather_run> & runs) {
    const bool scattered = runs.size() * 4 > (size_t) K;
    for (int32_t d = 0; d < n_rows; ++d) {
        uint16_t * r = (uint16_t *) (row0 + (size_t) d * row_bytes);
        if (scattered) {
            for (int32_t j = 0; j < K; ++j) {
                r[j] = r[src[j]];
            }
        } else {
            // forward element copies: a source is never below its destination, so an
            // overlapping run copies correctly, and short runs (pages) avoid a call each
            for (const auto & run : runs) {
                uint16_t * d = r + run.dst;
                const uint16_t * src_run = r + run.src;
                for (int32_t i = 0; i < run.len; ++i) {
                    d[i] = src_run[i];
                }
            }
        }
    }
}

struct host_layer_job {
    ggml_tensor * k;
    ggml_tensor * v;
    int32_t n_head;
    int32_t hd_k;
    int32_t hd_v;
    const int32_t * keep; // [n_head][K]
};

static void gather_host(const host_layer_job & job, bool v_trans, uint32_t kv_size, int32_t K, bool unordered,
        std::vector<char> & tmp) {
    ggml_tensor * k = job.k;
    ggml_tensor * v = job.v;
    const size_t k_head = ggml_row_size(k->type, job.hd_k);
    std::vector<gather_run> runs;
    for (int32_t h = 0; h < job.n_head; ++h) {
        const int32_t * src = job.keep + (size_t) h * K;
        std::vector<strided> parts;
        parts.push_back({ (char *) k->data + h * k_head, k->nb[1], k_head });
        if (!v_trans) {
            const size_t v_head = ggml_row_size(v->type, job.hd_v);
            parts.push_back({ (char *) v->data + h * v_head, v->nb[1], v_head });
        } else {
            // channel (h, d) of V is one contiguous row of kv_size elements
            const size_t es = ggml_type_size(v->type);
            char * row0 = (char *) v->data + ((size_t) h * job.hd_v * kv_size) * es;
            if (es == 2 && !unordered) {
                find_runs(K, src, runs);
                gather_rows_u16(row0, kv_size * es, job.hd_v, K, src, runs);
            } else {
                for (int32_t d = 0; d < job.hd_v; ++d) {
                    parts.push_back({ row0 + (size_t) d * kv_size * es, es, es });
                }
            }
        }
        for (const auto & a : parts) {
            if (unordered) {
                gather_unordered(a, K, src, tmp);
            } else {
                gather_sorted(a, K, src);
            }
        }
    }
}

// layers are independent: spread them over a few threads
static void gather_host_layers(const std::vector<host_layer_job> & jobs, bool v_trans, uint32_t kv_size, int32_t K,
        bool unordered) {
    const size_t n_threads = std::min<size_t>({ jobs.size(), (size_t) std::max(1u, std::thread::hardware_concurrency()), 8 });
    auto work = [&](size_t t) {
        std::vector<char> tmp;
        for (size_t i = t; i < jobs.size(); i += n_threads) {
            gather_host(jobs[i], v_trans, kv_size, K, unordered, tmp);
        }
    };
    std::vector<std::thread> threads;
    for (size_t t = 1; t < n_threads; ++t) {
        threads.emplace_back(work, t);
    }
    work(0);
    for (auto & th : threads) {
        th.join();
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

// n_view: cells 0..n_view-1 hold every source, so only they are transposed
static ggml_tensor * build_gather_vtrans(ggml_context * ctx, ggml_tensor * v, int32_t hd, int32_t n_head, uint32_t kv_size,
        uint32_t n_view, int32_t K, ggml_tensor * src_idx) {
    const size_t es = ggml_type_size(v->type);
    // [n_view, hd, n_head]: the first n_view elements of each channel row
    ggml_tensor * vt   = ggml_view_3d(ctx, v, n_view, hd, n_head, kv_size * es, (size_t) hd * kv_size * es, 0);
    ggml_tensor * rows = ggml_cont(ctx, ggml_transpose(ctx, vt));              // [hd, n_view, n_head]
    ggml_tensor * g    = ggml_get_rows(ctx, rows, src_idx);                     // [hd, K, n_head] F32
    ggml_tensor * gt   = ggml_cont(ctx, ggml_transpose(ctx, g));                // [K, hd, n_head] F32
    ggml_tensor * dst  = ggml_view_3d(ctx, v, K, hd, n_head, kv_size * es, (size_t) hd * kv_size * es, 0);
    return ggml_cpy(ctx, gt, dst);
}

// every used cell of the cache holds seq_id and nothing else; n: those cells
static int32_t only_sequence(const llama_kv_cells & cells, llama_seq_id seq_id, const char * cache, const char * op, uint32_t & n) {
    n = 0;
    for (uint32_t c = 0; c < cells.size(); ++c) {
        if (cells.is_empty(c)) {
            continue;
        }
        if (cells.seq_count(c) != 1 || !cells.seq_has(c, seq_id)) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_MULTI_SEQ, "%scell %u belongs to another sequence or to several: "
                    "%s needs sequence %d to be the only one in the cache", cache, c, op, seq_id);
        }
        n++;
    }
    return LLAMA_ENTROKV_OK;
}

// Move the data of cache kv: for every slot s (its layers' KV heads, layer-major), cell j receives
// cell cells_in[s*K + j]. Every layer's graph is planned before anything moves, so that an
// unsupported backend is refused with the cache intact. The cells' metadata is the caller's.
int32_t llama_entrokv_access::move_cells(llama_context * ctx, llama_kv_cache & kv, int32_t K, const int32_t * cells_in,
        bool force_graph, bool unordered) {
    const uint32_t kv_size = kv.get_size();
    const int32_t ns = n_slots(kv);
    uint32_t n_view = 0; // highest source cell + 1
    for (size_t i = 0; i < (size_t) ns * K; ++i) {
        n_view = std::max(n_view, (uint32_t) cells_in[i] + 1);
    }

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
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: the KV buffer has no device", l.il);
        }
        // the context's own backend for the device when it has one: a second instance would
        // share the device's state with it (ggml-vulkan frees shared resources with it)
        ggml_backend_t own = nullptr;
        for (const auto & be : ctx->backends) {
            if (ggml_backend_get_device(be.get()) == dev) {
                own = be.get();
                break;
            }
        }
        if (own == nullptr && !backends.count(dev)) {
            ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
            if (be == nullptr) {
                release();
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: cannot start a backend on device %s", l.il, ggml_backend_dev_name(dev));
            }
            backends[dev] = be;
        }
        g->backend = own != nullptr ? own : backends[dev];
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
            ggml_build_forward_expand(g->gf, build_gather_vtrans(g->ctx, l.v, hd_v, n_head, kv_size, n_view, K, g->src_idx));
        } else {
            ggml_build_forward_expand(g->gf, build_gather(g->ctx, l.v, hd_v, n_head, kv_size, g->src_idx, g->dst_idx));
        }
        for (int i = 0; i < ggml_graph_n_nodes(g->gf); ++i) {
            ggml_tensor * node = ggml_graph_node(g->gf, i);
            if (!ggml_backend_supports_op(g->backend, node)) {
                const std::string msg = std::string(ggml_op_desc(node)) + " on " + ggml_backend_name(g->backend);
                release();
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: the backend does not support %s", l.il, msg.c_str());
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
    // host layers first (all at once, threaded), then the graph layers
    std::vector<host_layer_job> host_jobs;
    for (size_t il = 0, slot0 = 0; il < kv.layers.size(); ++il) {
        const auto & l = kv.layers[il];
        const int32_t n_head = (int32_t) kv.hparams.n_head_kv(l.il);
        if (!graphs[il]) {
            host_jobs.push_back({ l.k, l.v, n_head, (int32_t) kv.hparams.n_embd_head_k(l.il),
                                  (int32_t) kv.hparams.n_embd_head_v(l.il), cells_in + slot0 * K });
        }
        slot0 += n_head;
    }
    gather_host_layers(host_jobs, kv.v_trans, kv_size, K, unordered);

    std::map<ggml_backend_t, ggml_gallocr_t> allocs;
    int32_t rc = LLAMA_ENTROKV_OK;
    for (size_t il = 0; il < kv.layers.size(); ++il) {
        const auto & l = kv.layers[il];
        auto & g = graphs[il];
        if (!g) {
            continue;
        }
        if (!allocs.count(g->backend)) {
            allocs[g->backend] = ggml_gallocr_new(ggml_backend_get_default_buffer_type(g->backend));
        }
        if (!ggml_gallocr_alloc_graph(allocs[g->backend], g->gf)) {
            rc = llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: cannot allocate the compaction graph (the cache is now partly compacted)", l.il);
            break;
        }
        ggml_backend_tensor_set(g->src_idx, g->src.data(), 0, ggml_nbytes(g->src_idx));
        ggml_backend_tensor_set(g->dst_idx, dst.data(), 0, ggml_nbytes(g->dst_idx));
        if (ggml_backend_graph_compute(g->backend, g->gf) != GGML_STATUS_SUCCESS) {
            rc = llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "layer %u: the compaction graph failed (the cache is now partly compacted)", l.il);
            break;
        }
    }
    for (auto & [_, a] : allocs) {
        ggml_gallocr_free(a);
    }
    release();
    return rc;
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
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "unknown flags 0x%x", flags);
    }
    if (lens == nullptr || cells_in == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "lens or cells is NULL");
    }
    if (n_slots_in != ns) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "got %d keep lists, the cache has %d (layer, KV head) slots", n_slots_in, ns);
    }
    if (seq_id < 0 || seq_id >= LLAMA_MAX_SEQ) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "invalid sequence id %d", seq_id);
    }

    // the cache must hold exactly one sequence, seq_id, and no pending shift
    uint32_t n_seq_cells = 0;
    if (int32_t rc = only_sequence(cells, seq_id, "", "compaction", n_seq_cells)) {
        return rc;
    }
    if (n_seq_cells == 0) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_EMPTY_SEQ, "sequence %d holds no token", seq_id);
    }
    if (cells.get_has_shift()) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_PENDING_SHIFT, "a K-shift is pending: decode once (or call llama_memory_update) before compacting");
    }

    // the keep lists
    const int32_t K = lens[0];
    for (int32_t s = 0; s < ns; ++s) {
        if (lens[s] != K) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_LIST_LENGTH, "keep lists have unequal lengths (slot 0: %d, slot %d: %d); "
                    "every (layer, KV head) must keep the same number of cells", K, s, lens[s]);
        }
    }
    if (K < 1 || (uint32_t) K > n_seq_cells) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_LIST_LENGTH, "keep length %d outside 1..%u (the cells of the sequence)", K, n_seq_cells);
    }
    const llama_pos pmax = cells.seq_pos_max(seq_id);
    if (pmax - K + 1 < 0) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_LIST_LENGTH, "keep length %d exceeds the positions of the sequence (max %d)", K, pmax);
    }
    const bool unordered = (flags & LLAMA_ENTROKV_COMPACT_UNORDERED) != 0;
    std::vector<int32_t> seen(unordered ? kv_size : 0, -1);
    for (int32_t s = 0; s < ns; ++s) {
        const int32_t * l = cells_in + (size_t) s * K;
        for (int32_t j = 0; j < K; ++j) {
            if (l[j] < 0 || (uint32_t) l[j] >= kv_size) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_RANGE, "slot %d: cell %d outside 0..%u", s, l[j], kv_size - 1);
            }
            if (unordered) {
                if (seen[l[j]] == s) {
                    return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_ORDER, "slot %d: cell %d listed twice", s, l[j]);
                }
                seen[l[j]] = s;
            } else if (j > 0 && l[j] <= l[j - 1]) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_ORDER, "slot %d: cells must be strictly ascending (%d then %d at index %d)",
                        s, l[j - 1], l[j], j);
            }
            if (cells.is_empty(l[j]) || !cells.seq_has(l[j], seq_id)) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_NOT_IN_SEQ, "slot %d: cell %d holds no token of sequence %d", s, l[j], seq_id);
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
    if (int32_t rc = move_cells(ctx, kv, K, cells_in, (flags & LLAMA_ENTROKV_COMPACT_GRAPH) != 0, unordered)) {
        return rc;
    }

    // the cells: 0..K-1 hold the sequence at positions pmax-K+1 .. pmax, everything else is free
    // (only seq_id lives in the cache, checked above, so freeing every cell frees exactly its cells)
    cells.reset();
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
    return llama_entrokv_ok();
}

// The sliding-window cache of an iswa model: drop the cells its window has passed (masked for the
// sequence's last position, as llama_state_seq_get_data leaves them out) and move the others, in
// position order, to cells 0..k-1 with their own positions. Later tokens attend to none of the
// dropped cells; what the attention reads shrinks from the cells used so far to about the window.
int32_t llama_entrokv_access::swa_trim(llama_context * ctx, llama_seq_id seq_id, int32_t * n_dropped) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    if (!t.iswa) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "the model has no sliding-window cache to trim");
    }
    if (seq_id < 0 || seq_id >= LLAMA_MAX_SEQ) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "invalid sequence id %d", seq_id);
    }
    llama_kv_cache & kv = *static_cast<llama_kv_cache_iswa *>(ctx->get_memory())->get_swa();
    if (kv.get_n_stream() != 1 || kv.layers.empty()) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "unsupported sliding-window cache (%u streams, %zu layers)",
                kv.get_n_stream(), kv.layers.size());
    }
    auto & cells = kv.v_cells[0];
    std::vector<std::pair<llama_pos, int32_t>> keep; // (position, cell)
    uint32_t n_seq_cells = 0;
    if (int32_t rc = only_sequence(cells, seq_id, "sliding-window ", "trimming", n_seq_cells)) {
        return rc;
    }
    const llama_pos pmax = cells.seq_pos_max(seq_id);
    // a later cut of the sequence's tail would bring dropped cells back into the window: trim only where
    // the base cache refuses such cuts, right after a compaction through the last position
    const llama_entrokv_state * st = t.kv->entrokv.get();
    if (n_seq_cells > 0 && (st == nullptr || !st->compacted() || st->pos_hi != pmax)) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "trim the sliding-window cache right after a compaction "
                "(the base cache is compacted through position %d, the sequence ends at %d)", st && st->compacted() ? st->pos_hi : -1, pmax);
    }
    for (uint32_t c = 0; c < cells.size(); ++c) {
        if (!cells.is_empty(c) && !llama_hparams::is_masked_swa(kv.n_swa, kv.swa_type, cells.pos_get(c), pmax)) {
            keep.emplace_back(cells.pos_get(c), (int32_t) c);
        }
    }
    if (cells.get_has_shift()) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_PENDING_SHIFT, "a K-shift is pending: decode once (or call llama_memory_update) before trimming");
    }
    std::sort(keep.begin(), keep.end());
    const int32_t K = (int32_t) keep.size();
    bool in_place = true; // nothing to drop and every kept cell already where it would go
    for (int32_t j = 0; j < K && in_place; ++j) {
        in_place = keep[j].second == j;
    }
    if (n_dropped != nullptr) {
        *n_dropped = (int32_t) (n_seq_cells - (uint32_t) K);
    }
    if (in_place && (uint32_t) K == n_seq_cells) {      // also an empty sequence
        return llama_entrokv_ok();
    }
    std::vector<int32_t> list(K);
    bool ascending = true;
    for (int32_t j = 0; j < K; ++j) {
        list[j] = keep[j].second;
        ascending = ascending && (j == 0 || list[j] > list[j - 1]);
    }
    const int32_t ns = n_slots(kv);
    std::vector<int32_t> lists((size_t) ns * K);
    for (int32_t s = 0; s < ns; ++s) {
        std::copy(list.begin(), list.end(), lists.begin() + (size_t) s * K);
    }
    if (int32_t rc = move_cells(ctx, kv, K, lists.data(), false, !ascending)) {
        if (n_dropped != nullptr) {
            *n_dropped = 0;
        }
        // a graph layer that failed after others moved: their cells no longer match the positions
        const std::string why = llama_entrokv_last_error();
        return llama_entrokv_fail(rc, "trimming the sliding-window cache failed (%s); some of its layers may have moved: "
                "remove the sequence (llama_memory_seq_rm(mem, seq, -1, -1)) before decoding again", why.c_str());
    }
    cells.reset();
    for (int32_t j = 0; j < K; ++j) {
        cells.pos_set((uint32_t) j, keep[j].first);
        cells.seq_add((uint32_t) j, seq_id);
    }
    kv.v_heads[0] = (uint32_t) K % kv.get_size();
    return llama_entrokv_ok();
}

int32_t llama_entrokv_access::restore(llama_context * ctx, int32_t n_keep, const int32_t * tpos, size_t n) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    llama_kv_cache & kv = *t.kv;
    const auto & cells = kv.v_cells[0];
    const int32_t ns = n_slots(kv);
    if (n_keep < 1 || (uint32_t) n_keep > cells.size() || tpos == nullptr || n != (size_t) ns * n_keep) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "restore needs n_keep in 1..%u and n_slots * n_keep = %d * %d true positions",
                cells.size(), ns, n_keep);
    }
    if (cells.is_empty(0)) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_EMPTY_SEQ, "cell 0 is empty: nothing to restore");
    }
    const llama_pos p_lo = cells.pos_get(0);
    for (int32_t j = 0; j < n_keep; ++j) {
        if (cells.is_empty(j) || cells.pos_get(j) != p_lo + j || cells.seq_count(j) != 1) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_NOT_IN_SEQ,
                    "cell %d does not hold position %d of a single sequence: not the saved compacted layout", j, p_lo + j);
        }
    }
    // each slot's true positions: distinct, within 0 .. the last compacted position
    const llama_pos p_hi = p_lo + n_keep - 1;
    std::vector<uint8_t> seen((size_t) p_hi + 1);
    for (int32_t s = 0; s < ns; ++s) {
        std::fill(seen.begin(), seen.end(), 0);
        for (int32_t j = 0; j < n_keep; ++j) {
            const int32_t v = tpos[(size_t) s * n_keep + j];
            if (v < 0 || v > p_hi || seen[v]) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_ORDER,
                        "slot %d: true positions must be distinct and within 0..%d (%d at cell %d)", s, p_hi, v, j);
            }
            seen[v] = 1;
        }
    }
    if (!kv.entrokv) {
        kv.entrokv = std::make_shared<llama_entrokv_state>();
    }
    auto & st = *kv.entrokv;
    st.n_keep   = (uint32_t) n_keep;
    st.pos_lo   = p_lo;
    st.pos_hi   = p_lo + n_keep - 1;
    st.n_slots  = ns;
    st.true_pos.assign(tpos, tpos + (size_t) ns * n_keep);
    st.n_compactions = std::max(st.n_compactions, 1);
    return llama_entrokv_ok();
}

int32_t llama_entrokv_access::set_last_logits(llama_context * ctx, const float * logits, int32_t n_vocab) {
    if (ctx == nullptr || logits == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "ctx or logits is NULL");
    }
    const int32_t expected = ctx->get_model().vocab.n_tokens();
    if (n_vocab != expected) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "got %d logits, the model's vocabulary has %d", n_vocab, expected);
    }
    if (ctx->output_reserve(1) < 1 || ctx->logits.data == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "cannot reserve the output buffer");
    }
    memcpy(ctx->logits.data, logits, (size_t) n_vocab * sizeof(float));
    std::fill(ctx->output_ids.begin(), ctx->output_ids.end(), -1);
    if (!ctx->output_ids.empty()) {
        ctx->output_ids[0] = 0;
    }
    ctx->n_outputs = 1;
    return llama_entrokv_ok();
}

int32_t llama_entrokv_access::n_refused(llama_context * ctx) {
    entrokv_target t;
    if (int32_t rc = resolve(ctx, t)) {
        return rc;
    }
    llama_entrokv_ok();
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
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "out is NULL");
    }
    return llama_entrokv_access::geometry(ctx, *out);
}

int32_t llama_entrokv_get_layer(llama_context * ctx, int32_t il_index, llama_entrokv_layer * out) {
    if (out == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "out is NULL");
    }
    return llama_entrokv_access::layer(ctx, il_index, *out);
}

int32_t llama_entrokv_true_pos(llama_context * ctx, int32_t * out, size_t n_out) {
    return llama_entrokv_access::true_pos(ctx, out, n_out);
}

int32_t llama_entrokv_value_norms(llama_context * ctx, float * out, size_t n_out) {
    try {
        return llama_entrokv_access::value_norms(ctx, out, n_out);
    } catch (const std::exception & e) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "reading V failed: %s", e.what());
    }
}

int32_t llama_entrokv_compact(llama_context * ctx, llama_seq_id seq_id, int32_t n_slots,
        const int32_t * lens, const int32_t * cells, uint32_t flags) {
    try {
        return llama_entrokv_access::compact(ctx, seq_id, n_slots, lens, cells, flags);
    } catch (const std::exception & e) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "compaction failed: %s", e.what());
    }
}

int32_t llama_entrokv_n_refused(llama_context * ctx) {
    return llama_entrokv_access::n_refused(ctx);
}

int32_t llama_entrokv_swa_trim(llama_context * ctx, llama_seq_id seq_id, int32_t * n_dropped) {
    try {
        return llama_entrokv_access::swa_trim(ctx, seq_id, n_dropped);
    } catch (const std::exception & e) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "trimming the sliding-window cache failed: %s", e.what());
    }
}

int32_t llama_entrokv_restore(llama_context * ctx, int32_t n_keep, const int32_t * true_pos, size_t n) {
    return llama_entrokv_access::restore(ctx, n_keep, true_pos, n);
}

int32_t llama_entrokv_set_last_logits(llama_context * ctx, const float * logits, int32_t n_vocab) {
    return llama_entrokv_access::set_last_logits(ctx, logits, n_vocab);
}

} // extern "C"
