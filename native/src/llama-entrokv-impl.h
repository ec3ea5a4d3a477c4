// EntroKV Edge: internal state and the hooks the patched llama_kv_cache calls.
// Not a public header: see native/include/llama-entrokv.h for the API.
#pragma once

#include "llama.h"

#include <cstddef>
#include <cstdint>
#include <vector>

class llama_kv_cache;
class llm_graph_result;
struct llm_graph_context;
struct llama_context;
struct ggml_tensor;
struct llama_entrokv_geometry;
struct llama_entrokv_layer;
struct llama_entrokv_scores;
struct llama_ubatch;
struct entrokv_rows_plan;

// the cache a context's calls act on: its KV cache, or the base cache of an iswa pair
struct entrokv_target {
    llama_kv_cache * kv   = nullptr;
    bool             iswa = false;
};

// Compaction state of one llama_kv_cache (single stream, single sequence).
// Cells 0..n_keep-1 hold compacted tokens with synthetic positions
// pos_lo..pos_hi; their true positions, per slot, are in true_pos.
struct llama_entrokv_state {
    uint32_t  n_keep        = 0;
    llama_pos pos_lo        = -1;
    llama_pos pos_hi        = -1;
    int32_t   n_slots       = 0;
    int32_t   n_compactions = 0;
    int32_t   n_refused     = 0;

    std::vector<int32_t> true_pos; // [n_slots][n_keep]

    bool compacted() const { return n_keep > 0; }

    void reset_compaction() {
        n_keep = 0;
        pos_lo = pos_hi = -1;
        n_compactions = 0;
        true_pos.clear();
    }
};

// F16 to float, exactly (F16C where the CPU has it, checked at run time): llama-entrokv-kernels.cpp
void entrokv_f16_to_f32(const uint16_t * src, float * dst, int64_t n);
// false when ENTROKV_NO_SIMD is set (not "" or "0"): the kernels take their plain C++ paths
bool entrokv_simd_allowed();

// set llama_entrokv_last_error() and return code; ok() clears it and returns 0
int32_t llama_entrokv_fail(int32_t code, const char * fmt, ...);
int32_t llama_entrokv_ok();

// friend of llama_kv_cache: everything that reads or writes its private members
struct llama_entrokv_access {
    // hooks (one line each in the patched llama-kv-cache.cpp)
    static void on_clear     (llama_kv_cache & kv);
    static void on_state_read(llama_kv_cache & kv, llama_seq_id seq_id);
    static bool allow_seq_rm (llama_kv_cache & kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    static bool allow_seq_shift(llama_kv_cache & kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1, const char * op);

    // the public API (llama-entrokv.cpp) is implemented through these
    static int32_t resolve  (llama_context * ctx, struct entrokv_target & t);
    static int32_t n_slots  (const llama_kv_cache & kv);
    static int32_t geometry (llama_context * ctx, struct llama_entrokv_geometry & g);
    static int32_t layer    (llama_context * ctx, int32_t i, struct llama_entrokv_layer & out);
    static int32_t true_pos (llama_context * ctx, int32_t * out, size_t n_out);
    // out [n_slots][n_cols]: true positions of cells 0..n_cols-1 (n_cols <= kv_size)
    static void    fill_true_pos(const llama_kv_cache & kv, int32_t * out, uint32_t n_cols);
    static int32_t value_norms(llama_context * ctx, float * out, size_t n_out);
    static int32_t compact  (llama_context * ctx, llama_seq_id seq_id, int32_t n_slots,
                             const int32_t * lens, const int32_t * cells, uint32_t flags);
    static int32_t move_cells(llama_context * ctx, llama_kv_cache & kv, int32_t K, const int32_t * cells,
                              bool force_graph, bool unordered);
    static int32_t swa_trim (llama_context * ctx, llama_seq_id seq_id, int32_t * n_dropped);
    static int32_t n_refused(llama_context * ctx);
    static int32_t restore  (llama_context * ctx, int32_t n_keep, const int32_t * true_pos, size_t n);
    static int32_t set_last_logits(llama_context * ctx, const float * logits, int32_t n_vocab);

    // rows of (slot, cell) pairs (llama-entrokv-rows.cpp); plan_rows makes the checks both share
    static int32_t plan_rows  (llama_context * ctx, struct entrokv_rows_plan & p, int32_t n_slots, const int32_t * lens,
                               const int32_t * cells, const void * k, size_t k_size, const void * v, size_t v_size,
                               bool keys_only);
    static int32_t read_cells (llama_context * ctx, int32_t n_slots, const int32_t * lens, const int32_t * cells,
                               void * k_out, size_t k_size, void * v_out, size_t v_size);
    static int32_t write_cells(llama_context * ctx, int32_t n_slots, const int32_t * lens, const int32_t * cells,
                               const int32_t * true_pos, const void * k_in, size_t k_size, const void * v_in, size_t v_size,
                               void * k_old, void * v_old);     // k_old, v_old: NULL, or a swap (the rows overwritten)

    // observation (llama-entrokv-observe.cpp)
    static void    after_ubatch   (llama_context & lctx, const llm_graph_result * res, const struct llama_ubatch & ubatch);
    static void    on_context_free(llama_context * lctx);
    static int32_t set_observer   (llama_context * ctx, int32_t window, bool queries_only, bool rows,
                                   void (*cb)(void *, const struct llama_entrokv_scores *), void * user_data);
    static int32_t last_scores    (llama_context * ctx, const struct llama_entrokv_scores ** out);
};

// called by the patched build_attn after the attention of an eligible layer: when the
// context observes (cparams.entrokv_window = w > 0) and the ubatch has >= w tokens, adds
// to the graph the mean attention of its last w queries over every cached key, per query
// head, as an output tensor [n_kv, n_head] of the graph result; `out` is the layer's attention output
// (for the decode observer: the model's own softmax is found among its sources)
void llama_entrokv_observe(const llm_graph_context & g, ggml_tensor * q, ggml_tensor * k, ggml_tensor * kq_mask,
        ggml_tensor * sinks, float kq_scale, int il, ggml_tensor * out);


