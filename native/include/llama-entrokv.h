// EntroKV Edge: per-(layer, KV head) compaction of a llama.cpp KV cache.
//
// Our public C API on top of llama.cpp (commit 0c1e57098bba). It acts on the
// llama_context that llama.cpp (or llama-cpp-python) already created. Every
// call returns LLAMA_ENTROKV_OK (0) or a negative error code; on error the
// cache is left exactly as it was and llama_entrokv_last_error() holds a
// message (thread-local, valid until the next call on the same thread).
//
// Vocabulary
//   eligible layer : a KV layer of the full-attention cache (for iswa models
//                    such as Gemma 3 only the base cache; the SWA cache is
//                    touched only by llama_entrokv_swa_trim).
//   slot           : one (eligible layer, KV head) pair; slots are numbered
//                    layer-major: all heads of eligible layer 0, then layer 1...
//   cell           : a row of the KV cache (0 .. kv_size-1), shared by every
//                    layer and head.
//   true position  : the position a token had in the prompt. After a
//                    compaction, cell j of slot s holds the token whose true
//                    position is llama_entrokv_true_pos(...)[s][j]; the
//                    positions that llama.cpp sees are synthetic.
#pragma once

#include "llama.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LLAMA_ENTROKV_API_VERSION 9

enum llama_entrokv_status {
    LLAMA_ENTROKV_OK                  =   0,
    LLAMA_ENTROKV_ERR_INVALID_ARG     =  -1, // null pointer, wrong slot count, bad flags
    LLAMA_ENTROKV_ERR_UNSUPPORTED     =  -2, // memory/model the method cannot act on
    LLAMA_ENTROKV_ERR_MULTI_SEQ       =  -3, // more than one sequence in the cache
    LLAMA_ENTROKV_ERR_PENDING_SHIFT   =  -4, // a K-shift is pending
    LLAMA_ENTROKV_ERR_LIST_LENGTH     =  -5, // unequal lengths, K == 0, K > cells of the sequence
    LLAMA_ENTROKV_ERR_CELL_RANGE      =  -6, // a cell index outside 0..kv_size-1
    LLAMA_ENTROKV_ERR_CELL_ORDER      =  -7, // a list not strictly ascending (unsorted or duplicate)
    LLAMA_ENTROKV_ERR_CELL_NOT_IN_SEQ =  -8, // a cell that does not hold a token of the sequence
    LLAMA_ENTROKV_ERR_EMPTY_SEQ       =  -9, // the sequence holds no token
    LLAMA_ENTROKV_ERR_BACKEND         = -10, // the backend cannot run the compaction graph
    LLAMA_ENTROKV_ERR_BUFFER_SIZE     = -11, // an output buffer is too small
};

// flags of llama_entrokv_compact
enum llama_entrokv_compact_flags {
    LLAMA_ENTROKV_COMPACT_DEFAULT = 0,      // host memcpy path when the buffers are host buffers, ggml graph otherwise
    LLAMA_ENTROKV_COMPACT_GRAPH     = 1, // always use the backend-agnostic ggml graph path
    LLAMA_ENTROKV_COMPACT_UNORDERED = 2, // lists may be in any order (still without duplicates):
                                         // cell j of slot s receives cells[s*K + j]
};

struct llama_entrokv_geometry {
    int32_t  n_layers;        // eligible KV layers
    int32_t  n_slots;         // sum over eligible layers of n_head_kv
    uint32_t kv_size;         // cells in the (base) cache
    uint32_t n_used;          // cells holding a token
    int32_t  v_trans;         // 1 if V is stored transposed (flash attention off)
    int32_t  is_iswa;         // 1 if the model also has a sliding-window cache (see llama_entrokv_swa_trim)
    int32_t  type_k;          // enum ggml_type
    int32_t  type_v;          // enum ggml_type
    int32_t  n_compacted;     // cells 0..n_compacted-1 hold compacted tokens (0: never compacted)
    int32_t  n_compactions;   // compactions since the cache was last cleared
    int32_t  pos_max;         // highest (synthetic = logical) position of sequence 0, -1 if empty
    int32_t  host_buffers;    // 1 if every eligible K/V buffer is a host buffer
};

struct llama_entrokv_layer {
    int32_t il;               // layer id in the model
    int32_t n_head_kv;
    int32_t head_dim_k;
    int32_t head_dim_v;
    int32_t slot0;            // first slot of this layer
    int32_t on_host;          // 1 if the K and V buffers of this layer are host buffers
    size_t  k_bytes_per_cell; // bytes of one cell of K in this layer (all heads)
    size_t  v_bytes_per_cell; // bytes of one cell of V in this layer (all heads)
};

// message of the last failed call on this thread ("" if none)
LLAMA_API const char * llama_entrokv_last_error(void);

LLAMA_API int32_t llama_entrokv_api_version(void);

LLAMA_API int32_t llama_entrokv_get_geometry(
        struct llama_context * ctx,
        struct llama_entrokv_geometry * out);

// il_index in 0 .. n_layers-1
LLAMA_API int32_t llama_entrokv_get_layer(
        struct llama_context * ctx,
        int32_t il_index,
        struct llama_entrokv_layer * out);

// Fill out[s * kv_size + c] with the true position of the token that cell c of
// slot s holds, or -1 for an empty cell. n_out must be >= n_slots * kv_size.
LLAMA_API int32_t llama_entrokv_true_pos(
        struct llama_context * ctx,
        int32_t * out,
        size_t n_out);

// Fill out[s * kv_size + c] with the Euclidean norm of the value vector (head_dim_v elements)
// that cell c of slot s holds, 0 for an empty cell. n_out must be >= n_slots * kv_size.
// V is read from whatever backend holds it (after llama_synchronize): each layer's cells up to
// the last used one, copied to the host (transposed V: in blocks of about 4 MiB of channel rows),
// and converted to float by ggml (F32, F16, BF16 and the quantized types). Reads only.
LLAMA_API int32_t llama_entrokv_value_norms(
        struct llama_context * ctx,
        float * out,
        size_t n_out);

// Compact sequence seq_id (which must be the only sequence in the cache).
//   n_slots : must equal the geometry's n_slots
//   lens    : [n_slots] list lengths; all must be equal (K)
//   cells   : the lists concatenated, slot-major: cells[s*K + j]
// Each list must be strictly ascending (any order without duplicates with
// LLAMA_ENTROKV_COMPACT_UNORDERED), within 0..kv_size-1 and name cells of seq_id. Afterwards cells 0..K-1 hold, for every slot, the listed tokens in
// list order, every other cell of the sequence is free, and the cells carry
// positions pos_max-K+1 .. pos_max.
LLAMA_API int32_t llama_entrokv_compact(
        struct llama_context * ctx,
        llama_seq_id seq_id,
        int32_t n_slots,
        const int32_t * lens,
        const int32_t * cells,
        uint32_t flags);

//
// Rows of single (slot, cell) pairs, for a store of evicted tokens outside the cache.
// The row of (slot s, cell c) is K: head_dim_k elements of the cache's type_k (the key as
// the cache holds it, RoPE applied at its true position), and V: head_dim_v elements of
// type_v - the same form whether V is stored transposed or not, so that rows read from one
// cache layout can be written into another. Bytes per row: the layer's k_bytes_per_cell /
// n_head_kv and v_bytes_per_cell / n_head_kv. Rows are moved as bytes (exactly), with
// ggml_backend_tensor_get/set, so any backend works; on host buffers that is a memcpy.
// Quantized V stored transposed (flash attention off) is not supported.
//
//   lens  : [n_slots] rows per slot (0 allowed; slots may differ)
//   cells : the slots' cell lists concatenated, slot-major: cells[sum(lens[0..s-1]) + j]
//   k, v  : the rows in the same order; k_size / v_size must be exactly the bytes of those rows
//

// Copy the rows of the listed cells out of the cache. Every cell must hold a token (a cell may
// be listed more than once). Reads only. v_out NULL with v_size 0: the K rows only (API 4).
LLAMA_API int32_t llama_entrokv_read_cells(
        struct llama_context * ctx,
        int32_t n_slots,
        const int32_t * lens,
        const int32_t * cells,
        void * k_out,
        size_t k_size,
        void * v_out,
        size_t v_size);

// Write the given rows into the listed cells, and make true_pos (same layout as cells) the
// true positions those cells hold for their slot from now on. Only compacted cells
// (0 .. n_compacted-1, still holding their compacted token) can be written: their tokens
// differ per slot already, and a slot keeps exactly as many tokens as before. Each true
// position must be in 0 .. the last compacted position and held by no other cell of the
// slot afterwards (no duplicate token in a buffer). Everything is checked before anything is
// written: on error the cache and its true positions are as they were.
LLAMA_API int32_t llama_entrokv_write_cells(
        struct llama_context * ctx,
        int32_t n_slots,
        const int32_t * lens,
        const int32_t * cells,
        const int32_t * true_pos,
        const void * k_in,
        size_t k_size,
        const void * v_in,
        size_t v_size);

// As llama_entrokv_write_cells, and the rows the listed cells held before are copied out into
// k_old and v_old (k_size and v_size bytes, laid out as k_in and v_in; not overlapping them): a
// read and a write in one pass over the cache (API 9). The same checks, all before anything is
// written or copied out: on error the cache, its true positions and k_old / v_old are as they were.
LLAMA_API int32_t llama_entrokv_swap_cells(
        struct llama_context * ctx,
        int32_t n_slots,
        const int32_t * lens,
        const int32_t * cells,
        const int32_t * true_pos,
        const void * k_in,
        size_t k_size,
        const void * v_in,
        size_t v_size,
        void * k_old,
        void * v_old);

// Convert n elements of ggml type `type` (a cache's type_k / type_v: F32, F16, BF16 or a
// quantized type; n a multiple of its block size) to float, as ggml does.
LLAMA_API int32_t llama_entrokv_to_float(
        int32_t type,
        const void * src,
        float * dst,
        int64_t n);

//
// Observation: the attention of the last `window` queries of a ubatch, per eligible layer
// and query head, computed inside llama.cpp's graph on the backend holding the cache
// (the model's own scale, softcap, mask and sinks; flash attention on or off).
//

struct llama_entrokv_scores {
    int32_t   n_layers;     // observed (eligible) layers, in geometry order
    int32_t   n_head;       // query heads per layer (query head h reads KV head h / (n_head / n_head_kv))
    int32_t   n_head_kv;    // KV heads per layer
    int32_t   n_kv;         // cells covered: columns 0..n_kv-1
    int32_t   n_slots;      // n_layers * n_head_kv
    int32_t   window;       // w: queries averaged
    int32_t   n_tokens;     // tokens of the observed ubatch
    llama_pos pos_last;     // position of the last window query
    const int32_t * layer_ids; // [n_layers] model layer ids
    const float   * scores;    // [n_layers][n_head][n_kv]: mean over the window of the attention on each cell
    const int32_t * true_pos;  // [n_slots][n_kv]: true position of each cell's token per slot, -1 if empty
    int32_t   head_dim;     // elements of one query head (0 when layers differ: then queries is NULL)
    const float   * queries;   // [n_layers][window][n_head][head_dim]: the window's queries as attention
                               // sees them (RoPE applied, times the model's kq_scale), so that q . k is the
                               // logit (before any softcap) of a key k as the cache holds it
    int32_t   n_rows;       // cells covered by rows (0: no rows)
    const float   * rows;      // [n_layers][n_head][n_rows] or NULL: the decode observer's rows, the model's own
                               // attention of the ubatch's last token over cells 0..n_rows-1 (as the decode
                               // computed it: without flash attention and attention sinks only)
};

// Called from inside llama_decode, once per observed ubatch, on the decoding thread. The
// arrays are valid during the call only. It must not call llama_decode.
typedef void (*llama_entrokv_observer)(void * user_data, const struct llama_entrokv_scores * scores);

// Observe every following ubatch that has >= window tokens (window 0: stop observing).
// cb may be NULL: the scores are then only kept for llama_entrokv_last_scores.
LLAMA_API int32_t llama_entrokv_set_observer(
        struct llama_context * ctx,
        int32_t window,
        llama_entrokv_observer cb,
        void * user_data);

// Observe only the queries of every following ubatch that has >= window tokens: no attention is
// computed, so the observer sees scores == NULL, n_kv == 0 and true_pos == NULL, and queries as
// above (window 0: stop observing, as llama_entrokv_set_observer(ctx, 0, ...)). A decoded token's
// attention over the cache is a second pass over every cached key; its queries are a copy.
LLAMA_API int32_t llama_entrokv_set_query_observer(
        struct llama_context * ctx,
        int32_t window,
        llama_entrokv_observer cb,
        void * user_data);

// The decode observer: every following ubatch's last query, as llama_entrokv_set_query_observer with
// window 1, and that token's attention over the cache as the model computed it (rows: a copy of the
// softmax the decode itself made, not a second pass over the keys). Where the decode makes none
// (flash attention), adds attention sinks to it, or its logits are not q . k (a softcap, a bias,
// ALiBi), rows is NULL. cb NULL: stop observing.
LLAMA_API int32_t llama_entrokv_set_decode_observer(
        struct llama_context * ctx,
        llama_entrokv_observer cb,
        void * user_data);

// The scores of the last observed ubatch (valid until the next observed ubatch or
// llama_free). Returns LLAMA_ENTROKV_ERR_INVALID_ARG if nothing was observed yet.
LLAMA_API int32_t llama_entrokv_last_scores(
        struct llama_context * ctx,
        const struct llama_entrokv_scores ** out);

//
// Page-EntroKV selection in C (the same definitions as the Python controller)
//

struct llama_entrokv_params {
    int32_t budget;     // token slots per group buffer, rounded down to whole pages
    int32_t page_size;  // P
    int32_t sinks;      // s: leading positions isolated as sinks (and protected)
    int32_t recent;     // rho: trailing positions always kept
    float   tau;        // temperature of the entropy weights (1: w = c / sum c)
    int32_t page_max;   // 0: page score = attention mass (sum), 1: max
};

LLAMA_API struct llama_entrokv_params llama_entrokv_default_params(void);

// scores [n_layers][n_head][n] (window attention over positions 0..n-1) -> out_pages
// [n_layers][n_head_kv][N], ascending. Returns N (the same for every layer and group:
// budget / page_size pages, or every page when budget >= n) or a negative error: budget
// below the protected pages (LIST_LENGTH), bad shapes or parameters, or a score that is
// not an attention weight - NaN, infinite or negative (INVALID_ARG); n_out too small
// (BUFFER_SIZE). An all-zero head counts as uniform over the non-sink positions.
LLAMA_API int32_t llama_entrokv_select_pages(
        const float * scores,
        int32_t n_layers,
        int32_t n_head,
        int32_t n_head_kv,
        int32_t n,
        const struct llama_entrokv_params * params,
        int32_t * out_pages,
        size_t n_out);

// The swap decision of a recall (the recall tier of entrokv_edge/runtime/recall.py) for n_s
// slots at once; arrays are slot-major and dense (att's rows: att_ld apart). Per slot, for its n_tok x r queries (the
// recall's tokens x the slot's query heads), on one scale per query (say exp(x - shift)):
//   att     [n_tok, r, n_keep] : their attention over the compacted cells (normalised over the cache),
//                                a row every att_ld (>= n_keep) floats; times att_scale [n_tok, r]
//                                (each a float product) where att_scale is not NULL
//   w_cache [n_tok, r]         : the cache's total weight (finite, >= 0)
//   w_read  [n_tok, r, n_read] : the weights of the tokens of the stored pages read (store_page each)
//   ent     [n_read]           : >= 0 where a read token exists (its store entry), < 0 where not
//   true_pos [n_keep]          : the compacted cells' true positions (distinct, in 0 .. 2^26 - 1)
// protect [n_protect]: eviction pages (of page_size true positions) never displaced; store_page must
// be a multiple of page_size; max_groups: at most this many eviction pages are displaced per slot.
// The read pages and the resident tokens are scored together (each query renormalised over both):
// a mass is, for the query head that gives it most, the summed attention of the recall's tokens.
// The whole, unprotected eviction pages are ordered by mass, least first (ties: lower page first);
// the read pages in descending mass (ties: lower page first) each displace the next (tokens /
// page_size) of them for as long as the page's mass is larger than theirs. Out, per slot s:
// out_pages[s * n_read / store_page ..] the read pages taken, in that order (out_n_pages[s] of
// them); out_cells[s * n_read ..] the cells they displace, page after page (out_n_cells[s]).
// Reads only its inputs; a weight that is not finite, a query with no weight, or a true position
// out of range or held twice by a slot is refused (LLAMA_ENTROKV_ERR_INVALID_ARG).
LLAMA_API int32_t llama_entrokv_recall_plan(
        int32_t n_s, int32_t n_tok, int32_t r, int32_t n_keep,
        const float * att, int64_t att_ld, const float * att_scale, const float * w_cache, const float * w_read, const int32_t * ent, int32_t n_read,
        const int32_t * true_pos, const uint8_t * protect, int32_t n_protect,
        int32_t page_size, int32_t store_page, int32_t max_groups,
        int32_t * out_pages, int32_t * out_n_pages, int32_t * out_cells, int32_t * out_n_cells);

// The digests' ranking of a recall for n_s slots at once: which stored pages it reads. Per slot s:
//   q     [n_tok, r, d]  : the recall's queries (tokens x the slot's query heads), finite
//   lse   [n_tok, r]     : their log-sum-exp over the cache, finite
//   means [d, n_pages]   : the stored pages' digests (the mean of each page's keys), a row every
//                          means_ld (>= n_pages) floats, slot after slot (d rows each)
//   counts [n_pages]     : the page's stored tokens (0 .. 2^24; 0: the page is not in the store)
// The means are expected finite (a stored key's mean); they are not checked.
// A page's mass is, for the query head that gives it most, the sum over the tokens of
// min(1, count x exp(q . mean - lse)) (in floats; the exponential a polynomial good to a few ulp).
// Out: out[s * n_out ..] the n_out pages of largest mass among those with a token (ties: lower page
// first), -1 past the last of them. Reads only its inputs; a non-finite q or lse, or a count
// outside 0 .. 2^24, is refused (LLAMA_ENTROKV_ERR_INVALID_ARG).
LLAMA_API int32_t llama_entrokv_recall_rank(
        int32_t n_s, int32_t n_tok, int32_t r, int32_t d,
        const float * q, const float * lse, const float * means, int64_t means_ld,
        const int32_t * counts, int32_t n_pages, int32_t n_out, int32_t * out);

// The recall store's digests (per slot and page of true positions) after n tokens come into the
// store (sign +1) or leave it (sign -1): token i is in slot slot[i] (0 .. n_s - 1), page page[i]
// (0 .. n_pages - 1), with key keys[i * d .. i * d + d - 1] as floats. Per (slot, page) touched:
//   counts  [n_s, n_pages]     : + sign x its tokens
//   sums    [n_s, n_pages, d]  : + sign x the float sum of their keys (in the order given, first
//                                key first); exactly 0 when the page is left with no token
//   means_t [n_s, d, n_pages]  : sums / counts (divided in double, rounded to float; 0 when empty)
// Other pages are not touched. A slot or page out of range, or a count that would go below 0, is
// refused (LLAMA_ENTROKV_ERR_INVALID_ARG) before anything is written.
LLAMA_API int32_t llama_entrokv_digest_update(
        int32_t n, const int32_t * slot, const int32_t * page, const float * keys, int32_t d, int32_t sign,
        int32_t n_s, int32_t n_pages, float * sums, int64_t * counts, float * means_t);

// A softmax in place over rows of n floats: row (a, b), for a < n_a and b < n_b, starts at
// x + a * stride_a + b * ld. Each row becomes exp(x - max) (exactly 0 where x is -inf; the
// exponential a polynomial good to a few ulp); lse[a * n_b + b] = max + log(sum) and
// inv_total[a * n_b + b] = 1 / sum (either may be NULL). A row with a NaN, a +inf or no finite
// value is refused (LLAMA_ENTROKV_ERR_INVALID_ARG; the rows before it already done), and so are
// rows (a, b) that are not laid out a-major (stride_a >= (n_b - 1) * ld + n where n_a > 1).
LLAMA_API int32_t llama_entrokv_softmax_rows(
        float * x, int64_t n_a, int64_t stride_a, int64_t n_b, int64_t ld, int32_t n,
        float * lse, float * inv_total);

// For C programs: Page-EntroKV on sequence seq_id of a never-compacted cache, from the
// last observed scores (the observed ubatch must end the prompt), then compaction, and on
// a model with sliding-window layers llama_entrokv_swa_trim. Returns the tokens kept per
// group buffer, or a negative error: the cache untouched, except a BACKEND error of the
// compaction's or the trim's moves (their messages say what to do).
LLAMA_API int32_t llama_entrokv_evict(
        struct llama_context * ctx,
        llama_seq_id seq_id,
        const struct llama_entrokv_params * params);

// After llama_state_set_data / llama_state_seq_set_data of a compacted cache (which
// resets the table): tell the cache that cells 0..n_keep-1 are compacted cells whose true
// positions are true_pos[s * n_keep + j] (as llama_entrokv_true_pos gave them before the
// save). The cells must hold one sequence at consecutive positions from cell 0 on; each
// slot's true positions must be distinct and not above the last compacted position (they
// ascend after a compaction of ascending lists; written cells can break the order).
LLAMA_API int32_t llama_entrokv_restore(
        struct llama_context * ctx,
        int32_t n_keep,
        const int32_t * true_pos,
        size_t n_true_pos);

// After a state load: make `logits` (n_vocab floats, saved with the state) the context's
// logits of its last token, as llama_state_set_data does not bring them back, so that
// sampling can go on without re-evaluating a token (which a compacted cell forbids).
LLAMA_API int32_t llama_entrokv_set_last_logits(
        struct llama_context * ctx,
        const float * logits,
        int32_t n_vocab);

// Operations refused since the last clear because they would have corrupted
// a compacted cache (range seq_rm / seq_add / seq_div over compacted cells).
LLAMA_API int32_t llama_entrokv_n_refused(struct llama_context * ctx);

// Models with sliding-window layers (iswa, such as Gemma 3): drop from their cache the
// cells of sequence seq_id (the only sequence in it) that the window has passed - those
// masked for the sequence's last position, which llama_state_seq_get_data leaves out too -
// and move the others, in position order and with their positions, to cells 0..k-1.
// The sliding-window layers then read about n_swa cells instead of every cell used since
// the cache was filled. No later token attends to a dropped cell; removing tokens from the
// end afterwards (llama_memory_seq_rm) could bring back into the window positions whose
// cells are gone, so the trim is accepted only right after a compaction of the base cache
// through the sequence's last position (which refuses such cuts); INVALID_ARG otherwise.
// n_dropped (may be NULL): cells dropped. UNSUPPORTED for a model without sliding-window
// layers. On error the cache is unchanged, except after a backend failure while moving
// (BACKEND, as for llama_entrokv_compact): its message says to remove the sequence.
LLAMA_API int32_t llama_entrokv_swa_trim(
        struct llama_context * ctx,
        llama_seq_id seq_id,
        int32_t * n_dropped);

#ifdef __cplusplus
}
#endif
