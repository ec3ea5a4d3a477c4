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
    own, whatever the eviction's page size); ``directory``: keep the store's rows in a file there
    (memory-mapped, removed when the store goes) instead of host memory."""

    every: int = 4
    pages: int = 8
    page_size: int = 16
    directory: str | None = None
    turn_pages: int = 8

    def __post_init__(self):
        import os
        if self.directory is not None:
            d = os.fspath(self.directory)
            if not os.path.isdir(d) or not os.access(d, os.W_OK):
                raise ValueError(f"recall directory {d!r} is not a writable directory")
            object.__setattr__(self, "directory", d)
        for name in ("every", "pages", "page_size", "turn_pages"):
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


class _FileRows:
    """One slot's rows of a store kept in a file: a view over the file's segments (one per
    eviction, [n_slots, m, width] bytes each, memory-mapped); ``rows[idx]`` reads, ``rows[idx] = x``
    writes, only the pages of the file it touches come into memory."""

    def __init__(self, segs: list, s: int, width: int):
        self.segs, self.s, self.width = segs, s, width

    def __len__(self) -> int:
        return sum(m.shape[1] for _, m in self.segs)

    def _where(self, idx):
        idx = np.arange(len(self))[idx] if not isinstance(idx, np.ndarray) or idx.dtype == bool else idx
        starts = np.array([a for a, _ in self.segs])
        return np.atleast_1d(idx), np.searchsorted(starts, np.atleast_1d(idx), side="right") - 1, starts

    def __getitem__(self, idx) -> np.ndarray:
        scalar = np.ndim(idx) == 0 and not isinstance(idx, slice)
        idx, seg, starts = self._where(idx)
        out = np.empty((idx.size, self.width), np.uint8)
        for j in np.unique(seg):
            at = seg == j
            out[at] = self.segs[j][1][self.s, idx[at] - starts[j], : self.width]
        return out[0] if scalar else out

    def __setitem__(self, idx, rows) -> None:
        idx, seg, starts = self._where(idx)
        rows = np.asarray(rows, np.uint8).reshape(idx.size, self.width)
        for j in np.unique(seg):
            at = seg == j
            self.segs[j][1][self.s, idx[at] - starts[j], : self.width] = rows[at]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), self.width

    def __array__(self, dtype=None, copy=None):
        return self[:] if dtype is None else self[:].astype(dtype)


class Store:
    """The evicted tokens of every slot. Each slot holds the same number of entries (an eviction
    takes as many tokens from every group buffer, a recall swaps one for one).

    Per slot s: ``pos[s]`` int32 [M] true positions, ``k[s]`` / ``v[s]`` [M, row bytes] (the
    cache's bytes: uint8 arrays in host memory, or views of a memory-mapped file in ``directory``),
    ``sums[s]`` float32 [pages, head_dim] and ``counts[s]`` int [pages]: the sum of the keys (as
    floats) and the number of tokens of each page of true positions in the store. The digests
    (sums / counts) and positions stay in host memory either way."""

    def __init__(self, n_slots: int, page_size: int, type_k: str, directory: str | None = None):
        self.page, self.type_k = page_size, type_k
        self.pos = [np.zeros(0, np.int32) for _ in range(n_slots)]
        self.k: list = [None] * n_slots
        self.v: list = [None] * n_slots
        self.sums = [np.zeros((0, 0), np.float32) for _ in range(n_slots)]
        self.counts = [np.zeros(0, np.int64) for _ in range(n_slots)]
        self.file = None
        if directory is not None:     # a file of ours, unlinked when the store goes (nothing of the user's is touched)
            import tempfile
            self.file = tempfile.TemporaryFile(dir=directory, prefix="entrokv-store-")
            self.path = str(directory)
            self._segs: dict[str, list] = {"k": [], "v": []}

    @property
    def n_tokens(self) -> int:
        """Entries per slot."""
        return int(self.pos[0].size) if self.pos else 0

    def n_pages(self) -> int:
        """Pages (of true positions) with a token in the store, all slots together."""
        return int(sum((c > 0).sum() for c in self.counts))

    def nbytes(self) -> dict:
        """Bytes of the rows (in memory or in the file), the positions and the digests (in memory)."""
        rows = sum(a.shape[0] * a.shape[1] for a in self.k + self.v if a is not None)
        digests = sum(int((c > 0).sum()) * (s.shape[1] * 4 + 4) for s, c in zip(self.sums, self.counts))
        return {"rows": rows, "positions": sum(p.nbytes for p in self.pos), "digests": digests,
                "in_file": self.file is not None}

    def close(self) -> None:
        if self.file is not None:
            self._segs = {"k": [], "v": []}
            self.k = self.v = [None] * len(self.pos)
            self.file.close()
            self.file = None

    def _account(self, s: int, pos: np.ndarray, kf: np.ndarray, sign: int) -> None:
        pages = pos // self.page
        top = int(pages.max(initial=-1)) + 1
        if top > self.counts[s].size or self.sums[s].shape[1] != kf.shape[1]:
            grow = max(top, self.counts[s].size)
            sums = np.zeros((grow, kf.shape[1]), np.float32)
            sums[: self.sums[s].shape[0], : self.sums[s].shape[1]] = self.sums[s]
            counts = np.zeros(grow, np.int64)
            counts[: self.counts[s].size] = self.counts[s]
            self.sums[s], self.counts[s] = sums, counts
        np.add.at(self.sums[s], pages, sign * kf.astype(np.float32))
        np.add.at(self.counts[s], pages, sign)
        self.sums[s][pages[self.counts[s][pages] == 0]] = 0.0     # an emptied page: no rounding left behind

    def _append_file(self, name: str, rows: list) -> list:
        """Append one segment [n_slots, m, width] to the file; the slots' views of the rows."""
        width = max(r.shape[1] for r in rows)
        m = rows[0].shape[0]
        block = np.zeros((len(rows), m, width), np.uint8)
        for s, r in enumerate(rows):
            block[s, :, : r.shape[1]] = r
        self.file.seek(0, 2)
        off = self.file.tell()
        self.file.write(block.tobytes())
        self.file.flush()
        start = len(self.k[0]) if name == "k" and self.k[0] is not None else \
            len(self.v[0]) if name == "v" and self.v[0] is not None else 0
        self._segs[name].append((start, np.memmap(self.file, np.uint8, "r+", offset=off, shape=block.shape)))
        return [_FileRows(self._segs[name], s, r.shape[1]) for s, r in enumerate(rows)]

    def add(self, pos: list, k: list, v: list) -> None:
        """Append, per slot, tokens with their true positions and rows (equal counts per slot)."""
        for s in range(len(self.pos)):
            self._account(s, pos[s], rows_to_float(k[s], self.type_k), +1)
            self.pos[s] = np.concatenate([self.pos[s], pos[s].astype(np.int32)])
        if self.file is not None:
            self.k, self.v = self._append_file("k", k), self._append_file("v", v)
            return
        for s in range(len(self.pos)):
            self.k[s] = k[s].copy() if self.k[s] is None else np.concatenate([self.k[s], k[s]])
            self.v[s] = v[s].copy() if self.v[s] is None else np.concatenate([self.v[s], v[s]])

    def replace(self, s: int, idx: np.ndarray, pos: np.ndarray, k: np.ndarray, v: np.ndarray,
                kf_old: np.ndarray) -> None:
        """Entries ``idx`` of slot s (whose keys as floats are ``kf_old``) become the given tokens."""
        self._account(s, self.pos[s][idx], kf_old, -1)
        self._account(s, pos, rows_to_float(k, self.type_k), +1)
        self.pos[s][idx] = pos
        self.k[s][idx] = k
        self.v[s][idx] = v


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
            self.store = Store(g.n_slots, self.page, g.type_k, self.config.directory)
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
        if self.store is not None:
            self.store.close()
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
            return np.stack([np.pad(np.asarray(a), ((0, 0), (0, w - a.shape[1]))) for a in rows])
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
        self.store = Store(g.n_slots, self.page, g.type_k, self.config.directory)
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
        return self._swap(llm, g, slot, self.config.pages)

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
        return self._swap(llm, g, slot, self.config.turn_pages)

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

    def _swap(self, llm, g, slot, n_pages: int) -> int:
        """Plan every slot's swaps (``slot(s)`` gives its queries [I, r, d], their attention over the
        compacted cells [I, r, n_keep] and their log-sum-exp over the cache [I, r]), then move the
        rows: displaced tokens read out, stored ones written in, the store updated."""
        st, n_keep = self.store, self.n_keep
        tp = true_positions(llm)[:, :n_keep]
        P = self.eviction.page_size
        protect = np.zeros(max(int(tp.max()) + 1, self.n_at_eviction) + P, bool)
        for p in self.eviction.protected(self.n_at_eviction):            # the last eviction's sinks and recent pages
            protect[p * P:(p + 1) * P] = True
        plans = [self._plan_slot(s, *slot(s), tp[s], protect, n_pages) for s in range(g.n_slots)]
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
                   protect: np.ndarray, N: int):
        """Slot s's swaps: (cells to overwrite, store entries to bring, their keys as floats).
        q [I, r, d] the queries, att [I, r, n_keep] their attention over the compacted cells."""
        st = self.store
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
