"""Reselect: the eviction after a prompt read in pieces chooses among every token the prompt held.

The evictions between pieces are made before the question at the prompt's end is read (the guide
only previews it). What they drop is set aside (a store of K/V rows, runtime/store.py),
and the eviction after the prompt scores the resident tokens and the set-aside ones alike: the exact
attention of the question's window and of the lookahead draft over both, mixed as lookahead mixes them,
causal by true position. The policy then selects from all of them at the usual budget, and the chosen
set-aside tokens are written back into compacted cells the selection frees (``swap_in``).
"""
from __future__ import annotations

import numpy as np

from ..bindings import read_cells, write_cells


def _softmax_mean(q: np.ndarray, k: np.ndarray, kpos: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """q float32 [I, r, d] (logit = q . k), k float32 [n, d] at true positions kpos [n], queries at qpos
    [I] -> float64 [r, n]: each head's attention over those keys (query i sees kpos <= qpos[i]), mean over
    the queries."""
    lg = np.matmul(q.reshape(-1, q.shape[-1]), k.T).reshape(q.shape[0], q.shape[1], -1)     # [I, r, n] float32
    late = kpos[None, :] > qpos[:, None]                                                      # [I, n]
    if late.any():
        lg[np.broadcast_to(late[:, None, :], lg.shape)] = -np.inf
    lg -= lg.max(-1, keepdims=True)
    np.exp(lg, out=lg)
    lg /= lg.sum(-1, keepdims=True)
    return lg.mean(0, dtype=np.float64)


class UnionScores:
    """Scores by true position over the resident and the set-aside tokens, one layer at a time (what
    ``select_layers`` asks for).

    ``resident_keys``: slots [m] -> their cached keys float32 [m, n_res, d] (asked a layer at a time), at
    ``resident_pos`` int32 [S, n_res] (every slot holds the same number of cells); ``store``: the set-aside
    tokens; ``queries`` float32 [L, w, H, d] (the window's, the last at ``pos_last``); ``draft`` float32
    [L, k, H, d] or None (the drafted tokens', right after it); ``share``: lookahead_share (0: each query
    one vote)."""

    def __init__(self, resident_keys, resident_pos, store, queries, pos_last: int, draft, share: float, n: int):
        self.kr, self.pr, self.store = resident_keys, resident_pos, store
        self.q, self.draft, self.share, self.n = queries, draft, share, n
        w = queries.shape[1]
        self.qpos = pos_last - w + 1 + np.arange(w)
        self.dpos = None if draft is None else pos_last + 1 + np.arange(draft.shape[1])
        L, H = queries.shape[0], queries.shape[2]
        self.G = resident_pos.shape[0] // L
        self.r = H // self.G

    def present(self) -> np.ndarray:
        """bool [S, n]: the positions each slot holds, in the cache or set aside."""
        S = self.pr.shape[0]
        out = np.zeros((S, self.n), bool)
        rows = np.arange(S)[:, None]
        out[rows, self.pr] = True
        out[rows, self.store.pos] = True
        return out

    def layer(self, l: int) -> np.ndarray:
        """float64 [H, n]: layer l's scores by true position (0 where a group holds nothing)."""
        G, r, st = self.G, self.r, self.store
        out = np.zeros((G * r, self.n))
        M = st.pos.shape[1]
        kr = self.kr(l * G + np.arange(G))                                          # [G, n_res, d]
        for gi in range(G):
            s = l * G + gi
            heads = gi * r + np.arange(r)
            e = np.arange(M)
            ks = st.keys(st.k.gather(np.full_like(e, s), e))                      # [M, d]
            k = np.concatenate([kr[gi], ks]).astype(np.float32, copy=False)
            kpos = np.concatenate([self.pr[s], st.pos[s]])
            a = _softmax_mean(np.ascontiguousarray(self.q[l][:, heads]), k, kpos, self.qpos)
            if self.draft is not None:
                d = _softmax_mean(np.ascontiguousarray(self.draft[l][:, heads]), k, kpos, self.dpos)
                w, kd = self.q.shape[1], self.draft.shape[1]
                a = (w * a + kd * d) / (w + kd) if self.share == 0 else (1.0 - self.share) * a + self.share * d
            out[heads[:, None], kpos[None, :]] = a
        return out


def resident(llm, g, tp_now: np.ndarray, store):
    """The cache's keys, as a function of slots [m] -> float32 [m, n_res, d] read from the cache when asked
    (a layer's at a time, not every layer's at once), and their true positions int32 [S, n_res] (every slot
    holds as many cells: a token fills one cell in all)."""
    cells = [np.flatnonzero(t >= 0).astype(np.int32) for t in tp_now]
    none = np.zeros(0, np.int32)

    def keys(slots: np.ndarray) -> np.ndarray:
        want = set(np.asarray(slots).tolist())
        k, _ = read_cells(llm, [c if s in want else none for s, c in enumerate(cells)], g, buffers=True,
                          keys_only=True)                  # slot after slot, in slot order
        order = np.argsort(np.argsort(slots))               # each asked slot's place among them sorted
        return store.keys(k.reshape(len(want), cells[0].size, -1))[order]
    return keys, np.stack([t[c] for t, c in zip(tp_now, cells)])


def swap_in(llm, g, tp_now: np.ndarray, keep_pos: np.ndarray, store, chunk_rows: int) -> int:
    """Per slot, the kept true positions keep_pos [S, K] that the cache does not hold come back from
    ``store``: each is written into a compacted cell whose token is not kept, and that token takes its
    entry in the store. Everything is checked before anything moves; the rows then move a few slots at a
    time (about ``chunk_rows`` tokens: the rows in flight stay a few MiB whatever the prompt's length).
    Returns the tokens brought back (all slots)."""
    S, n_comp = g.n_slots, g.n_compacted
    n = int(max(tp_now.max(), keep_pos.max(), store.pos.max(initial=-1))) + 1
    cells, ents = [], []
    for s in range(S):
        want = np.zeros(n, bool)
        want[keep_pos[s]] = True
        held = np.zeros(n, bool)
        held[tp_now[s][tp_now[s] >= 0]] = True
        ent = np.flatnonzero(want[store.pos[s]] & ~held[store.pos[s]])
        if ent.size != int((want & ~held).sum()):
            raise ValueError("a kept position is neither in the cache nor set aside")
        c = np.arange(n_comp, dtype=np.int32)
        free = c[(tp_now[s, :n_comp] >= 0) & ~want[np.maximum(tp_now[s, :n_comp], 0)]][: ent.size]
        if free.size < ent.size:
            raise ValueError("no compacted cell left to bring a set-aside token back into")
        cells.append(free)
        ents.append(ent)
    none = np.zeros(0, np.int32)
    counts = np.array([e.size for e in ents])
    first = 0
    while first < S:
        last = first + 1
        while last < S and counts[first: last + 1].sum() <= chunk_rows:
            last += 1
        part = [cells[s] if first <= s < last else none for s in range(S)]
        si = np.repeat(np.arange(first, last), counts[first: last])
        if si.size:
            e = np.concatenate(ents[first: last])
            out_k, out_v = read_cells(llm, part, g, buffers=True)    # the displaced tokens, before they are overwritten
            k_in, v_in = store.k.gather(si, e), store.v.gather(si, e)
            kf_in = store.keys(k_in) if store.digests else None
            write_cells(llm, part, store.pos[si, e], k_in, v_in, g)
            out_pos = tp_now[si, np.concatenate(cells[first: last])]
            store.replace(si, e, out_pos, out_k.reshape(si.size, -1), out_v.reshape(si.size, -1), kf_in)
        first = last
    return int(counts.sum())
