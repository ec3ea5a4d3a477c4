"""The numeric kernels of our C API: the C Page-EntroKV selector and one-call eviction, and the
recall's kernels (its digests' update and ranking, its swap decision, a softmax over rows)."""
from __future__ import annotations

import numpy as np

from .native import c_api, check, check_int32_range, context_pointer, int32_arg


def _params(ffi, lib, *, budget: int, page_size: int, sinks: int, recent: int, tau: float, page_max: bool):
    p = ffi.new("struct llama_entrokv_params *", lib.llama_entrokv_default_params())
    p.budget, p.page_size = int32_arg("budget", budget), int32_arg("page_size", page_size)
    p.sinks, p.recent = int32_arg("sinks", sinks), int32_arg("recent", recent)
    p.tau, p.page_max = float(tau), int(bool(page_max))
    return p


def _defaults(page_size, sinks, recent, tau) -> tuple:
    """The settings given, the C library's defaults (llama_entrokv_default_params: the method's) for those
    that are not."""
    _, lib = c_api()
    d = lib.llama_entrokv_default_params()
    return tuple(x if v is None else v for v, x in zip((page_size, sinks, recent, tau),
                                                         (d.page_size, d.sinks, d.recent, d.tau)))


def select_pages_native(scores: np.ndarray, n_head_kv: int, *, budget: int, page_size: int | None = None,
                        sinks: int | None = None, recent: int | None = None, tau: float | None = None,
                        page_max: bool = False) -> np.ndarray:
    """The C Page-EntroKV selector: scores float32 [L, H, n] -> pages int32 [L, G, N]. Settings not
    given are the C library's defaults (the method's, as EvictionConfig's for page-entrokv)."""
    page_size, sinks, recent, tau = _defaults(page_size, sinks, recent, tau)
    ffi, lib = c_api()
    s = np.ascontiguousarray(scores, dtype=np.float32)
    if s.ndim != 3:
        raise ValueError(f"scores must be [L, H, n], got shape {s.shape}")
    L, H, n = (int32_arg(k, v) for k, v in zip(("L", "H", "n"), s.shape))
    G = int32_arg("n_head_kv", n_head_kv)
    p = _params(ffi, lib, budget=budget, page_size=page_size, sinks=sinks, recent=recent, tau=tau, page_max=page_max)
    out = np.empty(max(L * G * -(-n // max(page_size, 1)), 1), dtype=np.int32)
    N = check(lib.llama_entrokv_select_pages(ffi.from_buffer("float[]", s), L, H, G, n, p,
                                              ffi.from_buffer("int32_t[]", out), out.size))
    return out[: L * G * N].reshape(L, G, N)


def recall_plan(att: np.ndarray, w_cache: np.ndarray, w_read: np.ndarray, ent: np.ndarray, true_pos: np.ndarray,
                protect: np.ndarray, page_size: int, store_page: int, max_groups: int,
                att_scale: np.ndarray | None = None):
    """The recall's swap decision in C (llama_entrokv_recall_plan) for S slots: att float32 [S, I, r, n_keep]
    (attention over the compacted cells), and on one scale per query the cache's total weight w_cache
    [S, I, r] and the read pages' tokens' weights w_read [S, I, r, n_read]; ent [S, n_read] (< 0: no token);
    true_pos [S, n_keep]; protect bool [eviction pages]; att_scale [S, I, r]: when given, the attention is
    att x att_scale (a float32 product per value). Returns (pages int32 [S, n_read / store_page],
    n_pages [S], cells int32 [S, n_read], n_cells [S]): per slot the read pages taken in order and the
    cells they displace (the first n_pages[s] / n_cells[s] of each row)."""
    ffi, lib = c_api()
    if att.ndim != 4:
        raise ValueError(f"recall_plan: att must be [S, I, r, n_keep], got shape {att.shape}")
    S, I, r, n_keep = att.shape
    # rows of att may lie apart (a slice of a wider array, as the recall's attention is): passed with their stride
    ld = att.strides[-2] // 4 if att.dtype == np.float32 and att.strides[-1] == 4 else -1
    want = (I * r * ld * 4, r * ld * 4, ld * 4)
    dense = all(n == 1 or st == e for n, st, e in zip(att.shape[:3], att.strides[:3], want))
    if ld < n_keep or not dense or att.size == 0 or att.ctypes.data % 4:
        att, ld = np.ascontiguousarray(att, np.float32), n_keep
    wc = np.ascontiguousarray(w_cache, np.float32)
    wr = np.ascontiguousarray(w_read, np.float32)
    sc = None if att_scale is None else np.ascontiguousarray(att_scale, np.float32)
    n_read = wr.shape[-1] if wr.ndim == 4 else -1
    ent = np.where(np.asarray(ent) >= 0, 0, -1).astype(np.int32)        # only whether a token is there counts
    tp = np.asarray(true_pos)
    if tp.size and (tp.min() < 0 or tp.max() >= 2**31):
        raise ValueError(f"recall_plan: true positions must be in 0 .. 2^31 - 1, got {tp.min()} .. {tp.max()}")
    tp = np.ascontiguousarray(tp, np.int32)
    prot = np.ascontiguousarray(protect, np.uint8)
    if (wc.shape != (S, I, r) or (sc is not None and sc.shape != (S, I, r)) or wr.shape != (S, I, r, n_read)
            or ent.shape != (S, n_read) or tp.shape != (S, n_keep)):
        raise ValueError(f"recall_plan: shapes att {att.shape}, w_cache {wc.shape}, w_read {wr.shape}, ent {ent.shape}, "
                         f"true_pos {tp.shape} do not agree")
    n_pages = n_read // max(int(store_page), 1)
    pages, n_p = np.zeros((S, max(n_pages, 1)), np.int32), np.zeros(S, np.int32)
    cells, n_c = np.zeros((S, max(n_read, 1)), np.int32), np.zeros(S, np.int32)
    i32 = lambda a: ffi.from_buffer("int32_t[]", a)     # noqa: E731
    check(lib.llama_entrokv_recall_plan(
        S, I, r, n_keep, ffi.cast("float *", att.ctypes.data), ld,
        ffi.NULL if sc is None else ffi.from_buffer("float[]", sc), ffi.from_buffer("float[]", wc),
        ffi.from_buffer("float[]", wr) if wr.size else ffi.NULL, i32(ent) if ent.size else ffi.NULL, n_read,
        i32(tp), ffi.from_buffer("uint8_t[]", prot) if prot.size else ffi.NULL, prot.size,
        int32_arg("page_size", page_size), int32_arg("store_page", store_page), int32_arg("max_groups", max_groups),
        i32(pages), i32(n_p), i32(cells), i32(n_c)))
    return pages[:, :n_pages], n_p, cells[:, :n_read], n_c


def recall_rank(q: np.ndarray, lse: np.ndarray, means_t: np.ndarray, counts: np.ndarray, n_out: int) -> np.ndarray:
    """The recall's digest ranking in C (llama_entrokv_recall_rank) for S slots: q float32 [S, I, r, d] the
    queries, lse [S, I, r] their log-sum-exp over the cache, means_t float32 [S, d, pages] the stored pages'
    mean keys, counts [S, pages] their stored tokens. A page's mass is, for the head that gives it most,
    the sum over the queries of min(1, count x exp(q . mean - lse)). Returns int32 [S, n_out]: per slot
    the n_out pages of largest mass among those with a token (ties: lower page first), -1 past them."""
    ffi, lib = c_api()
    if q.ndim != 4 or means_t.ndim != 3:
        raise ValueError(f"recall_rank: q must be [S, I, r, d] and means_t [S, d, pages], got {q.shape}, {means_t.shape}")
    S, I, r, d = q.shape
    qq = np.ascontiguousarray(q, np.float32)
    ll = np.ascontiguousarray(lse, np.float32)
    # the means' rows may lie apart (a view of a wider array): passed with their stride
    m = means_t if means_t.dtype == np.float32 and means_t.strides[-1] == 4 else np.ascontiguousarray(means_t, np.float32)
    ld = m.strides[1] // 4
    if m.size and (m.strides[0] != d * ld * 4 or m.strides[1] % 4 or ld < m.shape[2] or m.ctypes.data % 4):
        m = np.ascontiguousarray(m)
        ld = m.shape[2]
    n_pages = m.shape[2]
    c = np.ascontiguousarray(counts, np.int32)
    if ll.shape != (S, I, r) or m.shape[:2] != (S, d) or c.shape != (S, n_pages):
        raise ValueError(f"recall_rank: shapes q {q.shape}, lse {ll.shape}, means_t {m.shape}, counts {c.shape} "
                         "do not agree")
    out = np.zeros((S, max(int(n_out), 1)), np.int32)
    if S == 0:
        return out[:, :n_out]
    check(lib.llama_entrokv_recall_rank(
        S, I, r, d, ffi.from_buffer("float[]", qq) if qq.size else ffi.NULL,
        ffi.from_buffer("float[]", ll) if ll.size else ffi.NULL,
        ffi.cast("float *", m.ctypes.data) if m.size else ffi.NULL, max(ld, n_pages),
        ffi.from_buffer("int32_t[]", c) if c.size else ffi.NULL, n_pages, int32_arg("n_out", n_out),
        ffi.from_buffer("int32_t[]", out)))
    return out


def digest_update(si: np.ndarray, pages: np.ndarray, keys: np.ndarray, sign: int, sums: np.ndarray, counts: np.ndarray,
                  means_t: np.ndarray) -> None:
    """The recall store's digests after tokens come in (sign +1) or leave (-1), in place, in C
    (llama_entrokv_digest_update): token i in slot si[i], page pages[i], key keys[i] (float32 [n, d]);
    sums float32 [S, pages, d], counts int64 [S, pages], means_t float32 [S, d, pages], each C-contiguous.
    Refused (EntroKVError, nothing changed) for a slot or page out of range or a count below 0."""
    ffi, lib = c_api()
    S, npg, d = sums.shape
    for a, dt, shape in ((sums, np.float32, (S, npg, d)), (counts, np.int64, (S, npg)), (means_t, np.float32, (S, d, npg))):
        if a.dtype != dt or a.shape != shape or not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"digest_update: sums [S, pages, d] float32, counts [S, pages] int64 and means_t [S, d, pages] "
                             f"float32 must be writeable C-contiguous arrays, got {sums.shape}, {counts.shape}, {means_t.shape}")
    n = int(np.size(si))
    if np.shape(pages) != (n,) or np.shape(si) != (n,) or np.shape(keys) != (n, d):
        raise ValueError(f"digest_update: si [n], pages [n], keys [n, {d}], got {np.shape(si)}, {np.shape(pages)}, "
                         f"{np.shape(keys)}")
    if not n:
        return
    for a in (si, pages):
        check_int32_range(np.asarray(a))
    s32, p32 = np.ascontiguousarray(si, np.int32), np.ascontiguousarray(pages, np.int32)
    kf = np.ascontiguousarray(keys, np.float32)
    check(lib.llama_entrokv_digest_update(n, ffi.from_buffer("int32_t[]", s32), ffi.from_buffer("int32_t[]", p32),
                                           ffi.from_buffer("float[]", kf), d, int(sign), S, npg,
                                           ffi.from_buffer("float[]", sums), ffi.from_buffer("int64_t[]", counts),
                                           ffi.from_buffer("float[]", means_t)))


def softmax_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A softmax in place in C (llama_entrokv_softmax_rows) over the rows of x, a float32 [A, B, n] array (a
    view whose rows may lie apart, each row's n floats contiguous, A-major): each row becomes exp(x - max) (0
    where x is -inf). Returns (lse, 1 / sum), float32 [A, B] each; EntroKVError for a row with a NaN, a +inf
    or no finite value."""
    ffi, lib = c_api()
    if x.ndim != 3 or x.dtype != np.float32 or not x.flags.writeable:
        raise ValueError(f"softmax_rows: x must be a writable float32 [A, B, n] array, got {x.dtype} {x.shape}")
    A, B, n = x.shape
    if x.strides[2] != 4 or x.strides[1] % 4 or x.strides[0] % 4 or min(x.strides) < 0 or x.ctypes.data % 4:
        raise ValueError(f"softmax_rows: each row's floats must be contiguous (strides {x.strides})")
    lse, inv = np.empty((A, B), np.float32), np.empty((A, B), np.float32)
    if x.size:
        check(lib.llama_entrokv_softmax_rows(ffi.cast("float *", x.ctypes.data), A, x.strides[0] // 4 if A > 1 else 0,
                                              B, x.strides[1] // 4 if B > 1 else n, n, ffi.from_buffer("float[]", lse),
                                              ffi.from_buffer("float[]", inv)))
    return lse, inv


def evict_native(llm, *, budget: int, page_size: int | None = None, sinks: int | None = None,
                 recent: int | None = None, tau: float | None = None, page_max: bool = False, seq_id: int = 0) -> int:
    """The C one-call eviction (last observed scores, then compaction); returns tokens kept per group.
    Settings not given are the C library's defaults (the method's)."""
    page_size, sinks, recent, tau = _defaults(page_size, sinks, recent, tau)
    ffi, lib = c_api()
    p = _params(ffi, lib, budget=budget, page_size=page_size, sinks=sinks, recent=recent, tau=tau, page_max=page_max)
    return check(lib.llama_entrokv_evict(context_pointer(llm), int32_arg("seq_id", seq_id), p))
