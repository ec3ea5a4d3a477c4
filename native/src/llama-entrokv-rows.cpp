// EntroKV Edge: rows of single (slot, cell) pairs in and out of a KV cache, for a store of
// evicted tokens that lives outside it (see llama_entrokv_read_cells / _write_cells in
// native/include/llama-entrokv.h).
//
// A row is one KV head's K slice of a cell (head_dim_k elements of type_k) and its V slice
// (head_dim_v elements of type_v, gathered from the channel rows when V is transposed). Bytes
// move with ggml_backend_tensor_get/set, which every backend implements (a memcpy on host
// buffers, done directly there). Consecutive cells of one list are moved as one span: on a
// device, one read (and for a write, one write back) per span instead of one per cell.

#include "llama-entrokv.h"
#include "llama-entrokv-impl.h"

#include "llama-context.h"
#include "llama-kv-cache.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <algorithm>
#include <cstring>
#include <vector>

// what one row call acts on, checked: the cache, each slot's layer and head, where each slot's
// list starts in cells[] (first[s] .. first[s+1]-1)
struct entrokv_rows_plan {
    struct layer_info {
        ggml_tensor * k;
        ggml_tensor * v;
        int32_t hd_v;
        size_t  k_row;   // bytes of one head's K slice
        size_t  v_row;   // bytes of one head's V slice (row form)
    };
    entrokv_target          t;
    uint32_t                kv_size = 0;
    bool                    v_trans = false;
    std::vector<layer_info> layers;
    std::vector<int32_t>    slot_layer;   // [n_slots] index into layers
    std::vector<int32_t>    slot_head;    // [n_slots] KV head within the layer
    std::vector<size_t>     first;        // [n_slots + 1]
};

namespace {

bool is_host(const ggml_tensor * t) {
    return t->buffer != nullptr && ggml_backend_buffer_is_host(t->buffer);
}

// copy n bytes between the tensor at offset and host memory, in the given direction
void tensor_io(ggml_tensor * t, bool write, void * host, size_t offset, size_t n) {
    if (is_host(t)) {
        char * p = (char *) t->data + offset;
        if (write) {
            memcpy(p, host, n);
        } else {
            memcpy(host, p, n);
        }
    } else if (write) {
        ggml_backend_tensor_set(t, host, offset, n);
    } else {
        ggml_backend_tensor_get(t, host, offset, n);
    }
}

// One head's slices of cells c0 .. c0+m-1 in a tensor of rows (K, or V not transposed):
// slice i is at offset (c0 + i) * pitch + head_off, `row` bytes, rows + i * row in host memory.
// A write with `old`: the slices it overwrites are copied there first (a swap, in one pass).
void move_rows(ggml_tensor * t, bool write, char * rows, uint32_t c0, int32_t m, size_t pitch, size_t head_off, size_t row,
        std::vector<char> & span, char * old = nullptr) {
    if (is_host(t)) {
        for (int32_t i = 0; i < m; ++i) {
            const size_t off = (size_t) (c0 + i) * pitch + head_off;
            if (write && old != nullptr) {
                tensor_io(t, false, old + (size_t) i * row, off, row);
            }
            tensor_io(t, write, rows + (size_t) i * row, off, row);
        }
        return;
    }
    // a device: the span of whole cells in one read; a write patches it and puts it back
    span.resize((size_t) m * pitch);
    ggml_backend_tensor_get(t, span.data(), (size_t) c0 * pitch, span.size());
    for (int32_t i = 0; i < m; ++i) {
        char * s = span.data() + (size_t) i * pitch + head_off;
        if (write) {
            if (old != nullptr) {
                memcpy(old + (size_t) i * row, s, row);
            }
            memcpy(s, rows + (size_t) i * row, row);
        } else {
            memcpy(rows + (size_t) i * row, s, row);
        }
    }
    if (write) {
        ggml_backend_tensor_set(t, span.data(), (size_t) c0 * pitch, span.size());
    }
}

// One head's V slices of cells c0 .. c0+m-1 in a transposed V: channel d of head h is a row of
// kv_size elements, in which the span's m elements are contiguous. `old`: as for move_rows.
void move_rows_vtrans(ggml_tensor * v, bool write, char * rows, uint32_t c0, int32_t m, int32_t h, int32_t hd,
        uint32_t kv_size, std::vector<char> & span, char * old = nullptr) {
    const size_t es  = ggml_type_size(v->type);
    const size_t row = (size_t) hd * es;
    span.resize((size_t) m * es);
    for (int32_t d = 0; d < hd; ++d) {
        const size_t off = ((size_t) (h * hd + d) * kv_size + c0) * es;
        if (write) {
            if (old != nullptr) {
                tensor_io(v, false, span.data(), off, span.size());
                for (int32_t i = 0; i < m; ++i) {
                    memcpy(old + (size_t) i * row + (size_t) d * es, span.data() + (size_t) i * es, es);
                }
            }
            for (int32_t i = 0; i < m; ++i) {
                memcpy(span.data() + (size_t) i * es, rows + (size_t) i * row + (size_t) d * es, es);
            }
            tensor_io(v, true, span.data(), off, span.size());
        } else {
            tensor_io(v, false, span.data(), off, span.size());
            for (int32_t i = 0; i < m; ++i) {
                memcpy(rows + (size_t) i * row + (size_t) d * es, span.data() + (size_t) i * es, es);
            }
        }
    }
}

// One head's V slices of the n listed cells in a transposed V on a host buffer, channel by
// channel: each channel row is walked once for all of them (per element, no call per span).
template <typename T>
void move_vtrans_host(ggml_tensor * v, bool write, char * rows, const int32_t * cells, size_t n, int32_t h, int32_t hd,
        uint32_t kv_size, char * old = nullptr) {
    T * out = (T *) rows;                       // rows: n x hd elements, row form
    T * was = (T *) old;                        // a write with old: what it overwrites, in the same form
    for (int32_t d = 0; d < hd; ++d) {
        T * ch = (T *) v->data + (size_t) (h * hd + d) * kv_size;
        if (write && was != nullptr) {
            for (size_t i = 0; i < n; ++i) {
                was[i * hd + d] = ch[cells[i]];
                ch[cells[i]] = out[i * hd + d];
            }
        } else if (write) {
            for (size_t i = 0; i < n; ++i) {
                ch[cells[i]] = out[i * hd + d];
            }
        } else {
            for (size_t i = 0; i < n; ++i) {
                out[i * hd + d] = ch[cells[i]];
            }
        }
    }
}

// move every listed row, slot by slot, each run of consecutive cells as one span (a write with k_old
// and v_old: a swap, the rows overwritten copied there as they go)
void move_all(const entrokv_rows_plan & p, bool write, const int32_t * cells, char * k, char * v,
        char * k_old = nullptr, char * v_old = nullptr) {
    std::vector<char> span;
    size_t ko = 0, vo = 0;
    for (size_t s = 0; s + 1 < p.first.size(); ++s) {
        const auto & li = p.layers[p.slot_layer[s]];
        const int32_t h = p.slot_head[s];
        const size_t n = p.first[s + 1] - p.first[s];
        // a transposed V on the host, in elements of 2 or 4 bytes: the slot's cells at once
        const size_t es = v != nullptr && p.v_trans && is_host(li.v) ? ggml_type_size(li.v->type) : 0;
        if (es == 2) {
            move_vtrans_host<uint16_t>(li.v, write, v + vo, cells + p.first[s], n, h, li.hd_v, p.kv_size, v_old ? v_old + vo : nullptr);
        } else if (es == 4) {
            move_vtrans_host<uint32_t>(li.v, write, v + vo, cells + p.first[s], n, h, li.hd_v, p.kv_size, v_old ? v_old + vo : nullptr);
        }
        const bool v_done = es == 2 || es == 4;
        for (size_t j = p.first[s]; j < p.first[s + 1]; ) {
            int32_t m = 1;
            while (j + m < p.first[s + 1] && cells[j + m] == cells[j] + m) {
                ++m;
            }
            const uint32_t c0 = (uint32_t) cells[j];
            move_rows(li.k, write, k + ko, c0, m, li.k->nb[1], (size_t) h * li.k_row, li.k_row, span, k_old ? k_old + ko : nullptr);
            if (v == nullptr || v_done) {
                // keys only (a read), or V moved above
            } else if (p.v_trans) {
                move_rows_vtrans(li.v, write, v + vo, c0, m, h, li.hd_v, p.kv_size, span, v_old ? v_old + vo : nullptr);
            } else {
                move_rows(li.v, write, v + vo, c0, m, li.v->nb[1], (size_t) h * li.v_row, li.v_row, span, v_old ? v_old + vo : nullptr);
            }
            ko += (size_t) m * li.k_row;
            vo += (size_t) m * li.v_row;
            j  += m;
        }
    }
}

} // namespace

int32_t llama_entrokv_access::plan_rows(llama_context * ctx, entrokv_rows_plan & p, int32_t n_slots_in, const int32_t * lens,
        const int32_t * cells, const void * k, size_t k_size, const void * v, size_t v_size, bool keys_only) {
    if (int32_t rc = resolve(ctx, p.t)) {
        return rc;
    }
    const llama_kv_cache & kv = *p.t.kv;
    const int32_t ns = n_slots(kv);
    if (n_slots_in != ns) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "got %d cell lists, the cache has %d (layer, KV head) slots", n_slots_in, ns);
    }
    if (lens == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "lens is NULL");
    }
    p.kv_size = kv.get_size();
    p.v_trans = kv.v_trans;
    for (size_t il = 0; il < kv.layers.size(); ++il) {
        const auto & l = kv.layers[il];
        const int32_t nh   = (int32_t) kv.hparams.n_head_kv(l.il);
        const int32_t hd_k = (int32_t) kv.hparams.n_embd_head_k(l.il);
        const int32_t hd_v = (int32_t) kv.hparams.n_embd_head_v(l.il);
        if ((int64_t) hd_k * nh != (int64_t) kv.hparams.n_embd_k_gqa(l.il) || (int64_t) hd_v * nh != (int64_t) kv.hparams.n_embd_v_gqa(l.il)) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "layer %u: K or V rows are not n_head_kv x head_dim", l.il);
        }
        if (kv.v_trans && ggml_is_quantized(l.v->type)) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "layer %u: transposed V of quantized type %s (flash attention off)",
                    l.il, ggml_type_name(l.v->type));
        }
        p.layers.push_back({ l.k, l.v, hd_v, ggml_row_size(l.k->type, hd_k), ggml_row_size(l.v->type, hd_v) });
        for (int32_t h = 0; h < nh; ++h) {
            p.slot_layer.push_back((int32_t) il);
            p.slot_head.push_back(h);
        }
    }
    size_t need_k = 0, need_v = 0;
    p.first.assign((size_t) ns + 1, 0);
    for (int32_t s = 0; s < ns; ++s) {
        if (lens[s] < 0) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_LIST_LENGTH, "slot %d: negative list length %d", s, lens[s]);
        }
        const auto & li = p.layers[p.slot_layer[s]];
        need_k += (size_t) lens[s] * li.k_row;
        need_v += (size_t) lens[s] * li.v_row;
        p.first[s + 1] = p.first[s] + (size_t) lens[s];
    }
    if (p.first[ns] > 0 && cells == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "cells is NULL");
    }
    if (keys_only) {
        need_v = 0;
    }
    if (k_size != need_k || v_size != need_v) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BUFFER_SIZE, "the rows take %zu bytes of K and %zu of V, got buffers of %zu and %zu",
                need_k, need_v, k_size, v_size);
    }
    if ((need_k > 0 && k == nullptr) || (need_v > 0 && v == nullptr)) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "a K or V buffer is NULL");
    }
    const auto & kc = kv.v_cells[0];
    for (int32_t s = 0; s < ns; ++s) {
        for (size_t j = p.first[s]; j < p.first[s + 1]; ++j) {
            const int32_t c = cells[j];
            if (c < 0 || (uint32_t) c >= p.kv_size) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_RANGE, "slot %d: cell %d outside 0..%u", s, c, p.kv_size - 1);
            }
            if (kc.is_empty((uint32_t) c)) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_NOT_IN_SEQ, "slot %d: cell %d holds no token", s, c);
            }
        }
    }
    return LLAMA_ENTROKV_OK;
}

int32_t llama_entrokv_access::read_cells(llama_context * ctx, int32_t n_slots_in, const int32_t * lens, const int32_t * cells,
        void * k_out, size_t k_size, void * v_out, size_t v_size) {
    entrokv_rows_plan p;
    // no V buffer at all: the keys only
    if (int32_t rc = plan_rows(ctx, p, n_slots_in, lens, cells, k_out, k_size, v_out, v_size, v_out == nullptr && v_size == 0)) {
        return rc;
    }
    llama_synchronize(ctx);     // the last decode may still be writing the cache on an asynchronous backend
    move_all(p, false, cells, (char *) k_out, (char *) v_out);
    return llama_entrokv_ok();
}

int32_t llama_entrokv_access::write_cells(llama_context * ctx, int32_t n_slots_in, const int32_t * lens, const int32_t * cells,
        const int32_t * tpos, const void * k_in, size_t k_size, const void * v_in, size_t v_size, void * k_old, void * v_old) {
    entrokv_rows_plan p;
    if (int32_t rc = plan_rows(ctx, p, n_slots_in, lens, cells, k_in, k_size, v_in, v_size, false)) {
        return rc;
    }
    const bool swap = k_old != nullptr || v_old != nullptr;
    if (swap && ((k_size > 0 && k_old == nullptr) || (v_size > 0 && v_old == nullptr))) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "a buffer for the rows overwritten is NULL");
    }
    llama_kv_cache & kv = *p.t.kv;
    const int32_t ns = (int32_t) p.slot_layer.size();
    if (p.first[ns] == 0) {
        return llama_entrokv_ok();
    }
    if (tpos == nullptr) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "true_pos is NULL");
    }
    auto * st = kv.entrokv.get();
    if (st == nullptr || !st->compacted()) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_RANGE, "the cache holds no compacted cell: only compacted cells can be written");
    }
    const auto & kc = kv.v_cells[0];
    const uint32_t n_keep = st->n_keep;
    // each slot's held true positions after the write must be distinct: the ones it keeps, plus the new ones
    // (the cells past the last used one hold nothing: the table stops there)
    uint32_t n_cols = p.kv_size;
    while (n_cols > 0 && kc.is_empty(n_cols - 1)) {
        --n_cols;
    }
    std::vector<int32_t> table((size_t) ns * n_cols);
    fill_true_pos(kv, table.data(), n_cols);
    std::vector<uint8_t> mark((size_t) st->pos_hi + 1, 0), written((size_t) n_keep, 0);
    for (int32_t s = 0; s < ns; ++s) {
        for (size_t j = p.first[s]; j < p.first[s + 1]; ++j) {
            const int32_t c = cells[j];
            if ((uint32_t) c >= n_keep || kc.pos_get((uint32_t) c) != st->pos_lo + c || kc.seq_count((uint32_t) c) != 1) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_RANGE, "slot %d: cell %d is not a compacted cell of one sequence "
                        "(cells 0..%u): only those hold a token per slot", s, c, n_keep - 1);
            }
            if (written[c]) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_ORDER, "slot %d: cell %d listed twice", s, c);
            }
            written[c] = 1;
            const int32_t v = tpos[j];
            if (v < 0 || v > st->pos_hi) {
                return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "slot %d: true position %d outside 0..%d (the compacted positions)",
                        s, v, st->pos_hi);
            }
        }
        // the positions the slot keeps: every cell not written (compacted cells below n_keep, then the rest)
        int32_t * held = table.data() + (size_t) s * n_cols;
        for (size_t j = p.first[s]; j < p.first[s + 1]; ++j) {
            held[cells[j]] = -1;
        }
        int32_t clash = -1;
        for (uint32_t c = 0; c < n_cols; ++c) {
            if (held[c] >= 0 && held[c] <= st->pos_hi) {
                mark[held[c]] = 1;
            }
        }
        for (size_t j = p.first[s]; j < p.first[s + 1] && clash < 0; ++j) {
            if (mark[tpos[j]]) {
                clash = tpos[j];
            }
            mark[tpos[j]] = 1;
        }
        // unmark what was marked (cheaper than clearing all of 0..pos_hi for every slot)
        for (uint32_t c = 0; c < n_cols; ++c) {
            if (held[c] >= 0 && held[c] <= st->pos_hi) {
                mark[held[c]] = 0;
            }
        }
        for (size_t j = p.first[s]; j < p.first[s + 1]; ++j) {
            mark[tpos[j]] = 0;
        }
        for (size_t j = p.first[s]; j < p.first[s + 1]; ++j) {
            written[cells[j]] = 0;
        }
        if (clash >= 0) {
            return llama_entrokv_fail(LLAMA_ENTROKV_ERR_CELL_ORDER, "slot %d: true position %d would be held twice by the slot", s, clash);
        }
    }
    llama_synchronize(ctx);
    move_all(p, true, cells, (char *) k_in, (char *) v_in, (char *) k_old, (char *) v_old);
    for (int32_t s = 0; s < ns; ++s) {
        for (size_t j = p.first[s]; j < p.first[s + 1]; ++j) {
            st->true_pos[(size_t) s * n_keep + cells[j]] = tpos[j];
        }
    }
    return llama_entrokv_ok();
}

extern "C" {

int32_t llama_entrokv_to_float(int32_t type, const void * src, float * dst, int64_t n) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_type_size((ggml_type) type) == 0) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "unknown ggml type %d", type);
    }
    const ggml_type t = (ggml_type) type;
    if (n < 0 || n % ggml_blck_size(t) != 0 || (n > 0 && (src == nullptr || dst == nullptr))) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "n = %lld must be >= 0 and a multiple of %s's block size (%lld), "
                "and src and dst non-NULL", (long long) n, ggml_type_name(t), (long long) ggml_blck_size(t));
    }
    if (t == GGML_TYPE_F32) {
        memcpy(dst, src, (size_t) n * sizeof(float));
    } else if (t == GGML_TYPE_F16) {          // exact either way; ours takes F16C where the CPU has it
        entrokv_f16_to_f32((const uint16_t *) src, dst, n);
    } else if (ggml_get_type_traits(t)->to_float != nullptr) {
        ggml_get_type_traits(t)->to_float(src, dst, n);
    } else {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_UNSUPPORTED, "%s cannot be converted to float", ggml_type_name(t));
    }
    return llama_entrokv_ok();
}

int32_t llama_entrokv_read_cells(llama_context * ctx, int32_t n_slots, const int32_t * lens, const int32_t * cells,
        void * k_out, size_t k_size, void * v_out, size_t v_size) {
    try {
        return llama_entrokv_access::read_cells(ctx, n_slots, lens, cells, k_out, k_size, v_out, v_size);
    } catch (const std::exception & e) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "reading rows failed: %s", e.what());
    }
}

int32_t llama_entrokv_write_cells(llama_context * ctx, int32_t n_slots, const int32_t * lens, const int32_t * cells,
        const int32_t * true_pos, const void * k_in, size_t k_size, const void * v_in, size_t v_size) {
    try {
        return llama_entrokv_access::write_cells(ctx, n_slots, lens, cells, true_pos, k_in, k_size, v_in, v_size, nullptr, nullptr);
    } catch (const std::exception & e) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "writing rows failed (the cache may be partly written): %s", e.what());
    }
}

int32_t llama_entrokv_swap_cells(llama_context * ctx, int32_t n_slots, const int32_t * lens, const int32_t * cells,
        const int32_t * true_pos, const void * k_in, size_t k_size, const void * v_in, size_t v_size, void * k_old, void * v_old) {
    if ((k_size > 0 && k_old == nullptr) || (v_size > 0 && v_old == nullptr)) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_INVALID_ARG, "a buffer for the rows overwritten is NULL");
    }
    try {
        return llama_entrokv_access::write_cells(ctx, n_slots, lens, cells, true_pos, k_in, k_size, v_in, v_size,
                k_size > 0 ? k_old : nullptr, v_size > 0 ? v_old : nullptr);
    } catch (const std::exception & e) {
        return llama_entrokv_fail(LLAMA_ENTROKV_ERR_BACKEND, "swapping rows failed (the cache may be partly written): %s", e.what());
    }
}

} // extern "C"
