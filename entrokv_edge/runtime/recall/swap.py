"""One recall's arithmetic: the queries' attention over the cache, the stored pages it ranks and reads,
the swap decision per (layer, KV head) slot, and the rows it moves.

The attention comes in two kinds: ``DecodedAttention`` (every query is a decoded token whose attention
the decode computed: a copy of it, no second pass over the cache) and ``ComputedAttention`` (the first
D queries decoded, the others computed exactly here from every held key, causal by true position).
``swap`` asks either for a few slots at a time, ``plan`` decides their swaps, and ``swap`` moves the rows.
"""
from __future__ import annotations

import numpy as np

from ...bindings import recall_plan, recall_rank, softmax_rows, swap_cells
from ..store import Store

CHUNK_BYTES = 16 << 20      # a recall's temporaries per group of slots planned together


class DecodedAttention:
    """Every query's attention as the decode computed it: q [S, D, r, d], att [S, D, r, n_keep] (over the
    compacted cells, normalised over the whole cache), lse [S, D, r] (their log-sum-exp over the cache)."""

    def __init__(self, q: np.ndarray, att: np.ndarray, lse: np.ndarray):
        self.q, self.att, self.lse = q, att, lse

    def for_slots(self, ss: np.ndarray):
        """(queries, attention over the compacted cells up to a scale, log-sum-exp, that scale or None) of the
        contiguous slots ss."""
        a, b = int(ss[0]), int(ss[-1]) + 1
        return self.q[a:b], self.att[a:b], self.lse[a:b], None


class ComputedAttention:
    """Queries qs float32 [S, I, r, d] at true positions qpos [I] over the cells they attend: the compacted
    cells (their keys ``resident`` [S, n_keep, d]) and the cells written since the eviction (``later``
    [S, m, d] or None), which hold true positions held_pos [S, n_keep + m]. The first D queries come with
    the decode's attention ``att_dec`` [S, D, r, n_keep] and its log-sum-exp ``lse_dec`` [S, D, r]; the
    others' attention is computed here, exactly."""

    def __init__(self, qs, qpos, resident, later, held_pos, n_keep: int, D: int = 0, att_dec=None, lse_dec=None):
        self.qs, self.resident, self.later, self.n = qs, resident, later, n_keep
        self.D, self.att_dec, self.lse_dec = D, att_dec, lse_dec
        self.I, self.r = qs.shape[1], qs.shape[2]
        self.n_all = held_pos.shape[1]
        # causality by true position: only the cells some query must not see need a mask (the compacted cells
        # precede every query; the cells written since hold the queries' own tokens)
        qc = qpos[D:]                   # the queries whose attention is computed
        self.late = np.flatnonzero((held_pos > qc.min()).any(0))
        self.late_seen = held_pos[:, self.late][:, None, :] <= qc[None, :, None]       # [S, I - D, late]

    def for_slots(self, ss: np.ndarray):
        """(queries [s, I, r, d], attention over the compacted cells [s, I, r, n_keep] up to a scale, log-sum-exp
        over the cache [s, I, r], that scale [s, I, r] or None: 1 / the softmax's sum) of the contiguous slots ss."""
        a, b = int(ss[0]), int(ss[-1]) + 1
        I, r, D, n, n_all = self.I, self.r, self.D, self.n, self.n_all
        q = self.qs[a:b]                                                    # [s, I, r, d]
        logit = np.empty((b - a, I, r, n_all), np.float32)                  # the first D: the decode's attention
        lc = logit.reshape(b - a, I * r, n_all)[:, D * r:]                   # a view: the computed queries' logits
        q2 = q[:, D:].reshape(b - a, (I - D) * r, -1)
        np.matmul(q2, self.resident[a:b].transpose(0, 2, 1), out=lc[..., :n])
        if self.later is not None:
            np.matmul(q2, self.later[a:b].transpose(0, 2, 1), out=lc[..., n:])
        lc = logit[:, D:]
        late = self.late
        if late.size:
            lc[..., late] = np.where(self.late_seen[a:b, :, None, :], lc[..., late], -np.inf)
        # the softmax in place (in C): the compacted cells (0..n_keep-1) precede every query, so each row has a
        # finite max
        lse, inv = (x.reshape(b - a, I - D, r) for x in softmax_rows(logit.reshape(b - a, I * r, n_all)[:, D * r:]))
        if not D:       # the attention over the compacted cells: these values times 1 / total (the plan multiplies)
            return q, logit[..., :n], lse, inv
        logit[:, :D, :, :n] = self.att_dec[a:b]
        scale = np.ones((b - a, I, r), np.float32)                           # the decode's attention as it is
        scale[:, D:] = inv
        return q, logit[..., :n], np.concatenate([self.lse_dec[a:b], lse], 1), scale


def swap(llm, g, store: Store, keys, tp: np.ndarray, attention, n_queries: int, n_pages: int, held: int,
         protect: np.ndarray, P: int, events=None) -> int:
    """Plan every slot's swaps, a few slots at a time (their temporaries bounded by CHUNK_BYTES), then move
    the rows: displaced tokens read out, stored ones written in, the store updated. ``keys``: the recall's
    resident keys (``ResidentKeys``, kept up to date); ``tp`` [S, n_keep]: the compacted cells' true
    positions; ``attention``: ``for_slots(ss)`` as DecodedAttention / ComputedAttention give it; ``held``:
    the cells the queries attend per slot; ``protect`` [eviction pages] the pages never displaced, of P
    positions; ``events`` (runtime/events.py) gets "recall_inputs" for each run of slots. Returns the tokens
    brought back (all slots together)."""
    page = store.page
    # a slot's temporaries: its queries' attention over the held cells (and a dense copy where the plan needs
    # one), the read pages' keys and their weights (the digests' ranking and the decision, in C, keep theirs
    # per call)
    per_slot = 4 * n_queries * (2 * held + 2 * n_pages * page) + 4 * n_pages * page * store.head_dim
    chunk = max(1, CHUNK_BYTES // max(per_slot, 1))
    runs = [np.arange(a, min(a + chunk, g.n_slots)) for a in range(0, g.n_slots, chunk)]
    cells, si, e, kf_old = [], [], [], []
    for ss in runs:
        q, att, lse, scale = attention.for_slots(ss)
        if events is not None and events.wants("recall_inputs"):
            events.emit("recall_inputs", slots=ss, att=att, lse=lse, scale=scale)
        c, i, j, k = plan(store, ss, q, att, lse, tp[ss], protect, P, n_pages, scale)
        cells += c
        if i.size:
            si.append(i), e.append(j), kf_old.append(k)
    if not si:
        return 0
    si, e, kf_old = np.concatenate(si), np.concatenate(e), np.concatenate(kf_old)
    pos_in = store.pos[si, e]
    # every slot's in turn: the stored rows written, the displaced tokens' rows read out in the same pass
    out_k, out_v = swap_cells(llm, cells, pos_in, store.k.gather(si, e), store.v.gather(si, e), g)
    cs, cc = np.repeat(np.arange(len(cells)), [c.size for c in cells]), np.concatenate(cells)
    out_k, out_v = out_k.reshape(si.size, -1), out_v.reshape(si.size, -1)
    kf_out = store.keys(out_k)                       # the displaced keys as floats [n, d] (as the keys are held)
    keys.moved(cs, cc, kf_old, pos_in)
    store.replace(si, e, tp[cs, cc], out_k, out_v, kf_old, kf_out)
    return int(si.size)


def _dot(q: np.ndarray, k: np.ndarray, dtype=np.float64) -> np.ndarray:
    """q [S, I, r, d] . k [S, n, d] -> [S, I, r, n] in ``dtype``, as one batched matrix product."""
    S, I, r, d = q.shape
    q = q.reshape(S, I * r, d).astype(dtype, copy=False)
    return np.matmul(q, k.astype(dtype, copy=False).transpose(0, 2, 1)).reshape(S, I, r, -1)


def plan(st: Store, ss: np.ndarray, q: np.ndarray, att: np.ndarray, lse_res: np.ndarray, tp: np.ndarray,
         protect: np.ndarray, P: int, N: int, att_scale: np.ndarray | None = None):
    """The swaps of slots ``ss`` (S of them), all at once.

    q [S, I, r, d] the queries; att [S, I, r, n_keep] their attention over the compacted cells (times
    att_scale [S, I, r] when given), whose true positions are tp [S, n_keep]; lse_res [S, I, r] their
    log-sum-exp over the cache; protect [eviction pages] the pages never displaced; P the eviction's
    page size; N the pages read per slot. Per slot: the digests rank the stored pages by the mass their
    mean key would get (at most 1 per query and head); the top N are read and scored exactly against the
    cache (their mass and the resident tokens' after renormalising over both); in that order, a page comes
    in while its mass beats that of the least attended whole, unprotected eviction pages it displaces (this
    last part in C: bindings.recall_plan). Returns (cells: per slot int32 [n_s], the cells to overwrite;
    si, e: the store entries coming in, in the same order; kf: their keys as floats)."""
    S = q.shape[0]
    sl = np.arange(S)
    rows = slice(int(ss[0]), int(ss[0]) + S) if np.array_equal(ss, ss[0] + sl) else ss     # a run: views, no copies
    # the digests' ranking, in C: the N pages of largest mass per slot (-1: fewer pages stored)
    short = recall_rank(q, lse_res, st.means_t[rows], st.counts[rows], N)           # [S, N]
    ok_short = short >= 0
    # the store entries of those pages: [S, N, page] (-1: none)
    page = st.page
    ent = st.table()[ss[:, None], np.maximum(short, 0)].astype(np.int64)
    ent[~ok_short] = -1
    ent = ent.reshape(S, -1)
    kf = st.keys(st.k.gather(np.broadcast_to(ss[:, None], ent.shape), np.maximum(ent, 0)))   # [S, N*page, d]
    # the read tokens' weights and the cache's on one scale per query (at most 1 each, one of them 1)
    w = _dot(q, kf, np.float32)                                                       # [S, I, r, N*page]
    gone_s, gone_t = np.nonzero(ent < 0)                                              # no token there
    if gone_s.size:
        w.transpose(0, 3, 1, 2)[gone_s, gone_t] = -np.inf
    shift = np.maximum(lse_res, w.max(-1)) if w.shape[-1] else lse_res.astype(np.float32)
    w -= shift[..., None]
    np.exp(w, out=w)
    # scored together with the resident tokens, the displaceable groups ordered, the swaps chosen: in C
    pages, n_take, out, n_out = recall_plan(att, np.exp(lse_res - shift), w, ent, tp, protect, P, page,
                                            N * (-(-page // P)), att_scale)     # no more groups than N pages displace
    cells = [out[s, : n_out[s]] for s in range(S)]
    pmask = np.arange(pages.shape[1])[None, :] < n_take[:, None]
    if not pmask.any():
        return cells, np.zeros(0, np.int64), np.zeros(0, np.int64), None
    prow = np.nonzero(pmask)[0]
    es = ent.reshape(S, -1, page)[prow, pages[pmask]]                                # [taken pages, page]
    ks = kf.reshape(S, -1, page, kf.shape[-1])[prow, pages[pmask]]
    ok = es >= 0
    return cells, np.broadcast_to(ss[prow][:, None], es.shape)[ok], es[ok], ks[ok]
