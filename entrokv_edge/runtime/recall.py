"""The recall tier: evicted tokens kept outside the attention cache, and brought back while an
answer is generated when its queries want them.

At every eviction, the tokens that leave a group buffer (a (layer, KV head) slot) go to the
store: their K and V rows in the cache's own types, their true positions, and per page of
``page_size`` true positions the mean of its keys (the digest, a float vector per page). While
the runtime generates, each decoded token is observed (its queries and its attention over the
cache); every ``every`` tokens, per slot:

1. the digests rank the stored pages by the attention mass their mean key would get from those
   queries (relative to the cache's own log-sum-exp, taken from the most attended cell);
2. the top ``pages`` pages are read and scored exactly;
3. a page comes back when its mass beats the mass of the resident tokens it displaces (the
   least attended compacted tokens, never a protected sink or recent page), which go to the
   store in its place.

Every group buffer keeps exactly its budget (UOR = 1); positions stay correct, since keys keep
their RoPE and the true-position table follows every swap. The design and its figures (mean
key digest, pages of 16, every = 4, pages = 8): docs/research.md, "Recall for evicted pages".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..bindings import geometry, read_cells, rows_to_float, true_positions, write_cells
from ..bindings.observe import WindowScores


@dataclass(frozen=True)
class RecallConfig:
    """``every``: decoded tokens between two recalls; ``pages``: pages read and offered per
    (layer, KV group) at each recall; ``page_size``: true positions per page of the store (its
    own, whatever the eviction's page size)."""

    every: int = 4
    pages: int = 8
    page_size: int = 16

    def __post_init__(self):
        for name in ("every", "pages", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096:
                raise ValueError(f"recall {name} must be an integer in 1..4096, got {v!r}")


def recall_config(value) -> RecallConfig | None:
    """The ``recall`` option: None / False (off), True (the defaults), a dict of RecallConfig's
    fields, or a RecallConfig."""
    if value is None or value is False:
        return None
    if value is True:
        return RecallConfig()
    if isinstance(value, RecallConfig):
        return value
    if isinstance(value, dict):
        return RecallConfig(**value)
    raise TypeError(f"recall must be True, False, a dict or a RecallConfig, got {value!r}")


class Store:
    """The evicted tokens of every slot. Each slot holds the same number of entries (an eviction
    takes as many tokens from every group buffer, a recall swaps one for one).

    Per slot s: ``pos[s]`` int32 [M] true positions, ``k[s]`` / ``v[s]`` uint8 [M, row bytes] (the
    cache's bytes), ``sums[s]`` float64 [pages, head_dim] and ``counts[s]`` int [pages]: the sum of
    the keys (as floats) and the number of tokens of each page of true positions in the store."""

    def __init__(self, n_slots: int, page_size: int, type_k: str):
        self.page, self.type_k = page_size, type_k
        self.pos = [np.zeros(0, np.int32) for _ in range(n_slots)]
        self.k: list[np.ndarray] = [None] * n_slots
        self.v: list[np.ndarray] = [None] * n_slots
        self.sums = [np.zeros((0, 0)) for _ in range(n_slots)]
        self.counts = [np.zeros(0, np.int64) for _ in range(n_slots)]

    @property
    def n_tokens(self) -> int:
        """Entries per slot."""
        return int(self.pos[0].size) if self.pos else 0

    def n_pages(self) -> int:
        """Pages (of true positions) with a token in the store, all slots together."""
        return int(sum((c > 0).sum() for c in self.counts))

    def nbytes(self) -> dict:
        rows = sum(a.nbytes for a in self.k if a is not None) + sum(a.nbytes for a in self.v if a is not None)
        digests = sum(int((c > 0).sum()) * (s.shape[1] * 4 + 4) for s, c in zip(self.sums, self.counts))
        return {"rows": rows + sum(p.nbytes for p in self.pos), "digests": digests}

    def _account(self, s: int, pos: np.ndarray, kf: np.ndarray, sign: int) -> None:
        pages = pos // self.page
        top = int(pages.max(initial=-1)) + 1
        if top > self.counts[s].size or self.sums[s].shape[1] != kf.shape[1]:
            grow = max(top, self.counts[s].size)
            sums = np.zeros((grow, kf.shape[1]))
            sums[: self.sums[s].shape[0], : self.sums[s].shape[1]] = self.sums[s]
            counts = np.zeros(grow, np.int64)
            counts[: self.counts[s].size] = self.counts[s]
            self.sums[s], self.counts[s] = sums, counts
        np.add.at(self.sums[s], pages, sign * kf.astype(np.float64))
        np.add.at(self.counts[s], pages, sign)

    def add(self, pos: list, k: list, v: list) -> None:
        """Append, per slot, tokens with their true positions and rows (equal counts per slot)."""
        for s in range(len(self.pos)):
            self._account(s, pos[s], rows_to_float(k[s], self.type_k), +1)
            self.pos[s] = np.concatenate([self.pos[s], pos[s].astype(np.int32)])
            self.k[s] = k[s].copy() if self.k[s] is None else np.concatenate([self.k[s], k[s]])
            self.v[s] = v[s].copy() if self.v[s] is None else np.concatenate([self.v[s], v[s]])

    def replace(self, s: int, idx: np.ndarray, pos: np.ndarray, k: np.ndarray, v: np.ndarray,
                kf_old: np.ndarray) -> None:
        """Entries ``idx`` of slot s (whose keys as floats are ``kf_old``) become the given tokens."""
        self._account(s, self.pos[s][idx], kf_old, -1)
        self._account(s, pos, rows_to_float(k, self.type_k), +1)
        self.pos[s][idx], self.k[s][idx], self.v[s][idx] = pos, k, v



def _lse(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))).squeeze(axis)


class Recall:
    """Observes decoded tokens (``observe``, an Observation handler with window 1) and swaps
    stored pages into the cache (``step``)."""

    def __init__(self, config: RecallConfig, eviction):
        """``eviction``: the EvictionConfig, whose protected pages (sinks, recent) are never displaced."""
        self.config, self.eviction = config, eviction
        # a store page is whole eviction pages: what leaves and comes back keeps every buffer made of whole
        # pages, which the next eviction selects from
        P = eviction.page_size
        self.page = -(-config.page_size // P) * P
        self.store: Store | None = None
        self.steps: list[tuple] = []          # per observed token: (queries [L, H, d], attention [L, H, n_keep])
        self.n_keep = 0                       # compacted cells after the last eviction (set by the runtime)
        self.n_at_eviction = 0                # logical length at the last eviction
        self.recalled = 0                     # tokens brought back, all slots together
        self.n_recalls = 0
        self.seconds = 0.0

    # --- eviction -----------------------------------------------------------------

    def on_evict(self, llm, tp_now: np.ndarray | None, cells: np.ndarray) -> None:
        """Before a compaction that keeps ``cells`` [n_slots, K] (tp_now: the slots' true positions,
        None when cells are positions): the slots' other tokens go to the store."""
        g = geometry(llm)
        self.n_at_eviction = g.pos_max + 1
        if self.store is None:
            self.store = Store(g.n_slots, self.page, g.type_k)
        if tp_now is None:
            tp_now = true_positions(llm)
        held = tp_now >= 0
        gone = []
        for s in range(g.n_slots):
            m = held[s].copy()
            m[cells[s]] = False
            gone.append(np.flatnonzero(m).astype(np.int32))
        if not gone[0].size:
            return
        k, v = read_cells(llm, gone)
        self.store.add([tp_now[s][gone[s]] for s in range(g.n_slots)], k, v)
        self.steps.clear()

    def reset(self) -> None:
        self.store, self.steps, self.n_keep, self.n_at_eviction = None, [], 0, 0

    # --- sessions -------------------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """The store as arrays (what a saved session keeps); the digests are recomputed on load."""
        st = self.store
        if st is None or not st.n_tokens:
            return {}
        # rows of different layers may differ in size: each slot's rows padded to the widest
        def stack(rows):
            w = max(a.shape[1] for a in rows)
            return np.stack([np.pad(a, ((0, 0), (0, w - a.shape[1]))) for a in rows])
        # the tokens observed since the last recall: a restored session recalls when this one would
        steps = [np.stack([x[i] for x in self.steps]) if self.steps else np.zeros(0) for i in range(4)]
        return {"recall_pos": np.stack(st.pos), "recall_k": stack(st.k), "recall_v": stack(st.v),
                "recall_info": np.array([self.n_keep, self.n_at_eviction], np.int64),
                "recall_q": steps[0], "recall_att": steps[1], "recall_amax": steps[2], "recall_pmax": steps[3]}

    def load(self, llm, a: dict) -> None:
        """Restore a store saved by ``arrays`` into this (emptied) recall, for ``llm``'s cache;
        ValueError if the arrays do not fit it."""
        self.reset()
        if not a:
            return
        g = geometry(llm)
        pos, k, v, info = (np.asarray(a[x]) for x in ("recall_pos", "recall_k", "recall_v", "recall_info"))
        q, att, amax, pmax = (np.asarray(a[x]) for x in ("recall_q", "recall_att", "recall_amax", "recall_pmax"))
        n_steps = q.shape[0] if q.ndim == 4 else 0
        if (q.size and (att.ndim != 4 or att.shape[:3] != q.shape[:3] or att.shape[3] != int(info[0])
                        or amax.shape != q.shape[:3] or pmax.shape != q.shape[:3] or q.shape[1] != g.n_layers)):
            raise ValueError("its recall store's observed steps do not fit this cache")
        kb = [l.k_bytes_per_cell // l.n_head_kv for l in g.layers for _ in range(l.n_head_kv)]
        vb = [l.v_bytes_per_cell // l.n_head_kv for l in g.layers for _ in range(l.n_head_kv)]
        M = pos.shape[-1] if pos.ndim == 2 else -1
        if (pos.ndim != 2 or pos.shape[0] != g.n_slots or k.shape[:2] != (g.n_slots, M) or v.shape[:2] != (g.n_slots, M)
                or k.shape[2] < max(kb) or v.shape[2] < max(vb) or info.shape != (2,) or int(info[0]) != g.n_compacted
                or (M and (pos.min() < 0 or pos.max() > g.pos_max))):
            raise ValueError("its recall store does not fit this cache")
        self.store = Store(g.n_slots, self.page, g.type_k)
        self.store.add([pos[s].astype(np.int32) for s in range(g.n_slots)],
                       [np.ascontiguousarray(k[s][:, : kb[s]]) for s in range(g.n_slots)],
                       [np.ascontiguousarray(v[s][:, : vb[s]]) for s in range(g.n_slots)])
        self.n_keep, self.n_at_eviction = int(info[0]), int(info[1])
        self.steps = [(q[i], att[i], amax[i], pmax[i]) for i in range(n_steps)]

    # --- generation -----------------------------------------------------------------

    def observe(self, view: WindowScores) -> None:
        """Inside llama_decode, for a decoded token: keep its queries and its attention over the
        compacted cells, and the most attended cell per head (for the log-sum-exp)."""
        if view.queries is None or self.n_keep == 0:
            return
        a = view.scores[:, :, :]
        amax = a.argmax(-1)                                                   # [L, H]
        pmax = np.take_along_axis(a, amax[..., None], -1)[..., 0]
        self.steps.append((view.queries[:, -1].copy(), np.array(a[:, :, : self.n_keep]), amax, pmax))

    def due(self) -> bool:
        return self.store is not None and self.store.n_tokens > 0 and len(self.steps) >= self.config.every

    def step(self, llm) -> int:
        """One recall from the decoded tokens observed since the last; returns the tokens brought
        back (all slots together)."""
        steps, self.steps = self.steps, []
        g = self._ready(llm)
        if not steps or g is None:
            return 0
        q = np.stack([x[0] for x in steps]).astype(np.float64)            # [I, L, H, d]
        att = np.stack([x[1] for x in steps])                              # [I, L, H, n_keep]
        amax = np.stack([x[2] for x in steps])                             # [I, L, H]
        pmax = np.stack([x[3] for x in steps]).astype(np.float64)
        G, r = self._groups(g, q.shape[2])
        # each query's log-sum-exp over the cache: the logit of its most attended cell - log(its weight)
        ref_cells = [np.unique(amax[:, s // G, (s % G) * r:(s % G + 1) * r]).astype(np.int32) for s in range(g.n_slots)]
        ref_k, _ = read_cells(llm, ref_cells)

        def slot(s):
            l, hs = s // G, slice((s % G) * r, (s % G + 1) * r)
            qs = q[:, l, hs]                                               # [I, r, d]
            kref = rows_to_float(ref_k[s], self.store.type_k).astype(np.float64)
            lref = np.einsum("ird,ird->ir", qs, kref[np.searchsorted(ref_cells[s], amax[:, l, hs])])
            return qs, att[:, l, hs], lref - np.log(np.maximum(pmax[:, l, hs], 1e-30))
        return self._swap(llm, g, slot)

    def turn(self, llm, queries: np.ndarray, pos_last: int) -> int:
        """A recall at a new turn, for its observed window's queries (float32 [L, w, H, d], the last
        at position ``pos_last``): their attention over the cache is computed exactly from every held
        key (read once), then pages are offered as for decoded tokens. Returns the tokens brought back."""
        self.steps.clear()
        g = self._ready(llm)
        if g is None or queries is None:
            return 0
        q = np.asarray(queries, np.float64).transpose(1, 0, 2, 3)          # [I, L, H, d]
        I = q.shape[0]
        qpos = pos_last - I + 1 + np.arange(I)
        G, r = self._groups(g, q.shape[2])
        tp = true_positions(llm)
        cells = [np.flatnonzero(t >= 0).astype(np.int32) for t in tp]
        k_all, _ = read_cells(llm, cells)

        def slot(s):
            l, hs = s // G, slice((s % G) * r, (s % G + 1) * r)
            qs = q[:, l, hs]
            kf = rows_to_float(k_all[s], self.store.type_k).astype(np.float64)
            logit = np.einsum("ird,cd->irc", qs, kf)
            seen = tp[s][cells[s]][None, :] <= qpos[:, None]                 # [I, cells]: causal, by true position
            logit = np.where(seen[:, None, :], logit, -np.inf)
            lse = _lse(logit)
            att = np.exp(logit - lse[:, :, None])[:, :, : self.n_keep]      # compacted cells are cells 0..n_keep-1
            return qs, att, lse
        return self._swap(llm, g, slot)

    def _ready(self, llm):
        """The geometry when a recall can run (a store, the compacted layout of the last eviction), else None."""
        st = self.store
        if st is None or not st.n_tokens or self.n_keep == 0:
            return None
        g = geometry(llm)
        return g if g.n_compacted == self.n_keep else None

    @staticmethod
    def _groups(g, n_head: int) -> tuple[int, int]:
        G = g.n_slots // g.n_layers
        return G, n_head // G

    def _swap(self, llm, g, slot) -> int:
        """Plan every slot's swaps (``slot(s)`` gives its queries [I, r, d], their attention over the
        compacted cells [I, r, n_keep] and their log-sum-exp over the cache [I, r]), then move the
        rows: displaced tokens read out, stored ones written in, the store updated."""
        st, n_keep = self.store, self.n_keep
        tp = true_positions(llm)[:, :n_keep]
        P = self.eviction.page_size
        protect = np.zeros(max(int(tp.max()) + 1, self.n_at_eviction) + P, bool)
        for p in self.eviction.protected(self.n_at_eviction):            # the last eviction's sinks and recent pages
            protect[p * P:(p + 1) * P] = True
        plans = [self._plan_slot(s, *slot(s), tp[s], protect) for s in range(g.n_slots)]
        cells = [c for c, _, _ in plans]
        if not sum(c.size for c in cells):
            return 0
        out_k, out_v = read_cells(llm, cells)             # the displaced tokens, before they are overwritten
        write_cells(llm, cells, [st.pos[s][i] for s, (_, i, _) in enumerate(plans)],
                    [st.k[s][i] for s, (_, i, _) in enumerate(plans)], [st.v[s][i] for s, (_, i, _) in enumerate(plans)])
        for s, (c, i, kf) in enumerate(plans):
            if c.size:
                st.replace(s, i, tp[s][c], out_k[s], out_v[s], kf)
        n = int(sum(c.size for c in cells))
        self.recalled += n
        return n

    def _plan_slot(self, s: int, q: np.ndarray, att: np.ndarray, lse_res: np.ndarray, tp: np.ndarray,
                   protect: np.ndarray):
        """Slot s's swaps: (cells to overwrite, store entries to bring, their keys as floats).
        q [I, r, d] the queries, att [I, r, n_keep] their attention over the compacted cells."""
        st, N = self.store, self.config.pages
        pos = st.pos[s]
        counts = st.counts[s]
        live = np.flatnonzero(counts > 0)
        if live.size == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.int64), None
        mean = st.sums[s][live] / counts[live, None]                        # [P, d]
        est = np.einsum("ird,pd->irp", q, mean)                             # the digest's logit estimate
        with np.errstate(over="ignore"):
            mass = np.minimum(1.0, counts[live] * np.exp(est - lse_res[:, :, None])).sum(0).max(0)
        short = live[np.argsort(-mass, kind="stable")[:N]]
        # read the shortlisted pages and score them exactly
        page_of = pos // self.page
        idx = np.flatnonzero(np.isin(page_of, short))
        kf = rows_to_float(st.k[s][idx], st.type_k)
        logit = np.einsum("ird,td->irt", q, kf.astype(np.float64))          # [I, r, m]
        lse_seen = np.logaddexp(lse_res, _lse(logit))                       # [I, r]
        tok = np.exp(logit - lse_seen[:, :, None]).sum(0)                   # [r, m]
        pages_m = page_of[idx]
        order = np.argsort(pages_m, kind="stable")
        idx, kf, tok, pages_m = idx[order], kf[order], tok[:, order], pages_m[order]
        starts = np.flatnonzero(np.r_[True, pages_m[1:] != pages_m[:-1]])
        page_score = np.add.reduceat(tok, starts, axis=1).max(0)            # [n short pages]
        res_score = (att * np.exp(lse_res - lse_seen)[:, :, None]).sum(0).max(0)   # [n_keep]
        # what can be displaced: whole eviction pages of compacted cells, none protected
        P = self.eviction.page_size
        cpage = tp // P
        order_c = np.argsort(cpage, kind="stable")
        cstarts = np.flatnonzero(np.r_[True, cpage[order_c][1:] != cpage[order_c][:-1]])
        cends = np.r_[cstarts[1:], order_c.size]
        whole = (cends - cstarts == P) & ~protect[tp[order_c[cstarts]]]
        groups = [order_c[a:b] for a, b, w in zip(cstarts, cends, whole) if w]
        gscore = np.array([res_score[c].sum() for c in groups])
        free = np.ones(len(groups), bool)
        take_cells, take_idx, take_kf = [], [], []
        ends = np.r_[starts[1:], idx.size]
        for j in np.argsort(-page_score, kind="stable"):
            sel = slice(starts[j], ends[j])
            m = ends[j] - starts[j]
            if m % P:
                continue
            cand = np.flatnonzero(free)
            if cand.size < m // P:
                break
            out = cand[np.argsort(gscore[cand], kind="stable")[: m // P]]
            if not page_score[j] > gscore[out].sum():
                break
            free[out] = False
            take_cells.append(np.concatenate([groups[i] for i in out]))
            take_idx.append(idx[sel])
            take_kf.append(kf[sel])
        if not take_cells:
            return np.zeros(0, np.int32), np.zeros(0, np.int64), None
        return (np.concatenate(take_cells).astype(np.int32), np.concatenate(take_idx),
                np.concatenate(take_kf))
