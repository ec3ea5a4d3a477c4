"""The recall tier: evicted tokens kept outside the attention cache, and brought back when the
queries being answered want them.

At every eviction, the tokens that leave a group buffer (a (layer, KV head) slot) go to the
store: their K and V rows in the cache's own types, their true positions, and per page of
``page_size`` true positions the mean of its keys (the digest, a float vector per page). Then,
per slot:

- while the runtime generates, each decoded token's queries and its attention over the cache are
  observed (the attention as the decode computed it: a copy, not a second pass over the cache); every
  ``every`` tokens that attention (where the decode made none, the queries against every held key; a held
  draft's queries, not decoded, the same way) scores the cache exactly, the digests rank the stored pages
  by the attention mass their mean key would get (relative to the cache's log-sum-exp; in C), and the top
  ``pages`` pages are read and scored exactly;
- at a new turn, the same with the turn's observed queries and ``turn_pages`` pages; those queries were
  computed on the cache before the recall, so the turn's window is then evaluated again on the recalled
  cache and its new queries recall once more (``turn_requery``); then the answer's first tokens are
  drafted and drive a last recall (``turn_draft``);
- a page comes back when its mass beats the mass of the resident tokens it displaces (the least
  attended whole eviction pages, never a protected sink or recent page), which go to the store in
  its place.

Every group buffer keeps exactly its budget (UOR = 1); positions stay correct, since keys keep
their RoPE and the true-position table follows every swap. The design and its figures (mean
key digest, pages of 16, every = 4, pages = 8, turn_pages = 128, the draft, the requery): docs/research.md,
"Recall for evicted pages".
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..bindings import (digest_update, geometry, read_cells, recall_plan, recall_rank, rows_to_float, softmax_rows,
                        swap_cells, true_positions)
from ..bindings.observe import WindowScores


@dataclass(frozen=True)
class RecallConfig:
    """``every``: decoded tokens between two recalls; ``pages``: pages read and offered per
    (layer, KV group) at each of them; ``turn_pages``: the same at a new turn; ``page_size``: true
    positions per page of the store (its own, rounded up to whole eviction pages); ``directory``:
    keep the store's rows in a file there (without a name, gone with the store) instead of host
    memory. Defaults: docs/research.md, "Recall for evicted pages: stage 2"."""

    every: int = 4
    pages: int = 8
    page_size: int = 16
    directory: str | None = None
    turn_pages: int = 128
    turn_draft: int = 16                  # answer tokens drafted at a turn to drive a second recall (0: none)
    hold_draft: bool = True               # decoding recalls also see the turn's draft queries not yet decoded
    turn_requery: bool = True             # the turn's window evaluated again after its recall, driving a second one

    def __post_init__(self):
        if self.directory is not None:
            d = os.fspath(self.directory)
            if not os.path.isdir(d) or not os.access(d, os.W_OK):
                raise ValueError(f"recall directory {d!r} is not a writable directory")
            object.__setattr__(self, "directory", d)
        for name, lo, hi in (("every", 1, 4096), ("pages", 1, 4096), ("page_size", 1, 4096),
                             ("turn_pages", 1, 4096), ("turn_draft", 0, 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"recall {name} must be an integer in {lo}..{hi}, got {v!r}")
        for name in ("hold_draft", "turn_requery"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"recall {name} must be True or False, got {getattr(self, name)!r}")


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


class _Rows:
    """Rows of every slot, [n_slots, M, width] bytes, as segments (one per eviction): arrays in host
    memory, or parts of a file read and written with positioned I/O (``os.preadv`` / ``os.pwrite``).
    Not memory-mapped: the kernel maps a file's cached neighbours into the process on every fault, so
    a mapped store would grow the process's resident memory by far more than the pages a recall reads."""

    GAP = 4096      # file reads merge entries closer than this: fewer calls, a few bytes more read

    def __init__(self, n_slots: int, width: int, file=None):
        self.n_slots, self.width, self.file = n_slots, width, file
        self.segs: list[tuple[int, object]] = []      # (first entry, array [n_slots, m, width] | its file offset)
        self.seg_n: list[int] = []                     # entries per slot in each segment
        self.n = 0

    def append(self, block: np.ndarray) -> None:
        """A new segment (one per eviction: nothing already stored is copied)."""
        block = np.ascontiguousarray(block, np.uint8)
        if self.file is None:
            self.segs.append((self.n, block))
        else:
            off = os.fstat(self.file.fileno()).st_size
            _pwrite(self.file.fileno(), block.reshape(-1), off)
            self.segs.append((self.n, off))
        self.seg_n.append(block.shape[1])
        self.n += block.shape[1]

    def pop(self) -> None:
        """Forget the last segment (its bytes stay in the file, unused)."""
        self.segs.pop()
        self.n -= self.seg_n.pop()

    def _parts(self, e: np.ndarray):
        """(which of e, segment, its first entry) for each segment that entries e lie in."""
        if len(self.segs) == 1:
            yield slice(None), 0, 0
            return
        starts = np.array([a for a, _ in self.segs])
        seg = np.searchsorted(starts, e, side="right") - 1
        for j in np.flatnonzero(np.bincount(seg.ravel(), minlength=len(self.segs))):
            yield seg == j, j, starts[j]

    def _offsets(self, j: int, si: np.ndarray, e: np.ndarray) -> np.ndarray:
        """File offsets of the rows (si, e - segment start) of file segment j."""
        return self.segs[j][1] + (si.astype(np.int64) * self.seg_n[j] + e) * self.width

    def _flat(self, j: int, si: np.ndarray, e: np.ndarray):
        """Memory segment j as rows [n_slots * m, width] and the row of each (si, e - segment start)."""
        seg = self.segs[j][1]
        return seg.reshape(-1, self.width), si * self.seg_n[j] + e     # a row index: faster than a 2-D fancy index

    def gather(self, si: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Rows (si[i], e[i]) for arrays of the same shape: [..., width]."""
        if self.file is None and len(self.segs) == 1:
            rows, at = self._flat(0, si, e)
            return np.take(rows, at, axis=0)
        out = np.empty(e.shape + (self.width,), np.uint8)
        for at, j, a in self._parts(e):
            if self.file is None:
                rows, i = self._flat(j, si[at], e[at] - a)
                out[at] = np.take(rows, i, axis=0)
            else:
                out[at] = _pread_rows(self.file.fileno(), self._offsets(j, si[at], e[at] - a), self.width, self.GAP)
        return out

    def scatter(self, si: np.ndarray, e: np.ndarray, rows: np.ndarray) -> None:
        for at, j, a in self._parts(e):
            if self.file is None:
                seg, i = self._flat(j, si[at], e[at] - a)
                seg[i] = rows[at]
            else:
                _pwrite_rows(self.file.fileno(), self._offsets(j, si[at], e[at] - a), rows[at], self.width)

    def __getitem__(self, s: int) -> np.ndarray:
        """Slot s's rows [M, width] (a copy for a file)."""
        e = np.arange(self.n)
        return self.gather(np.full_like(e, s), e)

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.n * self.width


def _pwrite(fd: int, data: np.ndarray, off: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, off)
        if n <= 0:
            raise OSError(f"recall store file: nothing written at offset {off}")
        view, off = view[n:], off + n


def _pwrite_rows(fd: int, offsets: np.ndarray, rows: np.ndarray, width: int) -> None:
    """Write rows [n, width] at the file ``offsets`` [n] (distinct), one call per run of adjacent rows."""
    order = np.argsort(offsets, kind="stable")
    off, rows = offsets[order], np.ascontiguousarray(rows.reshape(-1, width)[order])
    cut = np.r_[0, np.flatnonzero(np.diff(off) != width) + 1, off.size]
    for a, b in zip(cut[:-1].tolist(), cut[1:].tolist()):
        _pwrite(fd, rows[a:b].reshape(-1), int(off[a]))


def _pread_rows(fd: int, offsets: np.ndarray, width: int, gap: int) -> np.ndarray:
    """Rows of ``width`` bytes at the file ``offsets`` (any shape, any order): [*offsets.shape, width].
    Sorted, and rows less than ``gap`` bytes apart read in one call."""
    flat = offsets.ravel()
    u, inv = np.unique(flat, return_inverse=True)
    if not u.size:
        return np.empty(offsets.shape + (width,), np.uint8)
    cut = np.flatnonzero(np.diff(u) > width + gap) + 1
    first, last = u[np.r_[0, cut]], u[np.r_[cut, u.size] - 1] + width
    buf = np.empty(int((last - first).sum()), np.uint8)
    base = np.r_[0, np.cumsum(last - first)[:-1]]
    for f, l, b in zip(first.tolist(), last.tolist(), base.tolist()):
        view, got = memoryview(buf)[b: b + l - f], 0
        while got < l - f:
            n = os.preadv(fd, [view[got:]], f + got)
            if n <= 0:
                raise OSError(f"recall store file: short read at offset {f + got}")
            got += n
    run = np.repeat(np.arange(first.size), np.diff(np.r_[0, cut, u.size]))
    at = base[run] + (u - first[run])                        # each unique row's place in buf
    rows = np.lib.stride_tricks.as_strided(buf, (buf.size - width + 1, width), (1, 1), writeable=False)
    return rows[at[inv]].reshape(offsets.shape + (width,))   # rows taken by where they start: no index per byte


class Store:
    """The evicted tokens of every slot. Each slot holds the same number M of entries (an eviction
    takes as many tokens from every group buffer, a recall swaps one for one).

    ``pos`` int32 [S, M] true positions; ``k``, ``v`` (_Rows) [S, M, row bytes]: the cache's bytes, in
    host memory or in a file in ``directory``; ``sums`` float32 [S, pages, head_dim] and ``counts``
    [S, pages]: the sum of the keys (as floats) and the number of tokens of each page of true
    positions in the store; ``means_t`` float32 [S, head_dim, pages]: the digest, sums / counts (transposed,
    for the matrix products); ``table()`` int32 [S, pages, page
    size]: the entry holding each true position (-1: none). Positions and digests stay in memory.
    ``digests=False``: a store that only holds rows (what a reselect reads): no sums, counts or means kept,
    and ``table()`` not available."""

    def __init__(self, n_slots: int, page_size: int, type_k: str, k_width: int, v_width: int, head_dim: int,
                 directory: str | None = None, digests: bool = True):
        self.page, self.type_k, self.head_dim, self.digests = page_size, type_k, head_dim, digests
        self.file = None
        if directory is not None:     # a file of ours without a name: gone with the store, nothing of the user's touched
            import tempfile
            self.file = tempfile.TemporaryFile(dir=directory, prefix="entrokv-store-")
        self.pos = np.zeros((n_slots, 0), np.int32)
        self.k, self.v = _Rows(n_slots, k_width, self.file), _Rows(n_slots, v_width, self.file)
        self.sums = np.zeros((n_slots, 0, head_dim), np.float32)
        self.counts = np.zeros((n_slots, 0), np.int64)
        self.means_t = np.zeros((n_slots, head_dim, 0), np.float32)   # sums / counts, transposed, kept up to date
        self._table = None            # table(): built after each add, kept up to date by replace

    @property
    def n_tokens(self) -> int:
        """Entries per slot."""
        return int(self.pos.shape[1])

    def n_pages(self) -> int:
        """Pages (of true positions) with a token in the store, all slots together."""
        return int((self.counts > 0).sum())

    def nbytes(self) -> dict:
        """Bytes of the rows (in memory or in the file), the positions and the digests (in memory: the
        sums, counts and means of every page of true positions up to the store's last)."""
        return {"rows": self.k.nbytes + self.v.nbytes, "positions": self.pos.nbytes,
                "digests": self.sums.nbytes + self.counts.nbytes + self.means_t.nbytes}

    def close(self) -> None:
        if self.file is not None:
            self.k.segs.clear()
            self.v.segs.clear()
            self.file.close()
            self.file = None

    def keys(self, k_rows: np.ndarray) -> np.ndarray:
        """float32 [..., head_dim]: rows of K (uint8 [..., width]) as floats."""
        flat = k_rows.reshape(-1, k_rows.shape[-1])
        return rows_to_float(flat, self.type_k).reshape(k_rows.shape[:-1] + (self.head_dim,))

    def _account(self, si: np.ndarray, pos: np.ndarray, kf: np.ndarray, sign: int) -> None:
        """Add (sign +1) or remove (-1) tokens (slot si[i], position pos[i], key kf[i]) from the digests."""
        if not pos.size or not self.digests:
            return
        pages = pos // self.page
        top = int(pages.max(initial=-1)) + 1
        if top > self.counts.shape[1]:
            S = self.counts.shape[0]
            self.sums = np.concatenate([self.sums, np.zeros((S, top - self.sums.shape[1], self.head_dim), np.float32)], 1)
            self.counts = np.concatenate([self.counts, np.zeros((S, top - self.counts.shape[1]), np.int64)], 1)
            self.means_t = np.concatenate([self.means_t, np.zeros((S, self.head_dim, top - self.means_t.shape[2]),
                                                                  np.float32)], 2)
        digest_update(si, pages, kf, sign, self.sums, self.counts, self.means_t)     # in C, in place

    def add(self, pos: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Append tokens to every slot: pos [S, m], k [S, m, k width], v [S, m, v width]. The rows are
        stored first: if that fails (a full disk), the store is as it was."""
        S, m = pos.shape
        self.k.append(k)
        try:
            self.v.append(v)
        except BaseException:
            self.k.pop()
            raise
        step = max(1, (4 << 20) // max(1, m * self.head_dim * 4))     # the keys as floats, ~4 MiB at a time
        for a in range(0, S if self.digests else 0, step):
            b = min(S, a + step)
            si = np.repeat(np.arange(a, b), m)
            self._account(si, pos[a:b].ravel(), self.keys(k[a:b]).reshape(-1, self.head_dim), +1)
        self.pos = np.concatenate([self.pos, pos.astype(np.int32)], axis=1)
        self._table = None

    def table(self) -> np.ndarray:
        """int32 [S, pages, page size]: the entry of each true position, -1 where the store has none."""
        if not self.digests:
            raise ValueError("a store without digests keeps no table of pages")
        S, npg = self.counts.shape
        if self._table is None:
            self._table = np.full((S, npg, self.page), -1, np.int32)
            si = np.broadcast_to(np.arange(S)[:, None], self.pos.shape)
            self._table[si, self.pos // self.page, self.pos % self.page] = np.arange(self.n_tokens)
        elif self._table.shape[1] < npg:
            self._table = np.concatenate([self._table, np.full((S, npg - self._table.shape[1], self.page), -1,
                                                               np.int32)], 1)
        return self._table

    def replace(self, si: np.ndarray, e: np.ndarray, pos: np.ndarray, k: np.ndarray, v: np.ndarray,
                kf_old: np.ndarray, kf_new: np.ndarray | None = None) -> None:
        """Entries (si[i], e[i]), whose keys as floats are kf_old[i], become the tokens (pos, k, v) (their
        keys as floats kf_new, when the caller has them)."""
        old = self.pos[si, e]
        if self.digests:
            self._account(si, old, kf_old, -1)
            self._account(si, pos, self.keys(k) if kf_new is None else kf_new, +1)
        if self._table is not None:
            t = self.table()                # as many pages as the digests now
            t[si, old // self.page, old % self.page] = -1
            t[si, pos // self.page, pos % self.page] = e
        self.pos[si, e] = pos
        self.k.scatter(si, e, k)
        self.v.scatter(si, e, v)


def new_store(g, page_size: int, directory: str | None = None, digests: bool = True) -> Store:
    """An empty store for the cache of geometry ``g`` (ValueError when its layers differ in K or V head
    sizes; OSError when no file can be made in ``directory``)."""
    kw = {l.k_bytes_per_cell // l.n_head_kv for l in g.layers}
    vw = {l.v_bytes_per_cell // l.n_head_kv for l in g.layers}
    hd = {l.head_dim_k for l in g.layers}
    if len(kw) != 1 or len(vw) != 1 or len(hd) != 1:
        raise ValueError("recall needs every eligible layer to have the same K and V head sizes")
    return Store(g.n_slots, page_size, g.type_k, kw.pop(), vw.pop(), hd.pop(), directory, digests)


def set_aside(llm, store: Store, tp_now: np.ndarray | None, cells: np.ndarray, g=None) -> None:
    """Before a compaction that keeps ``cells`` [n_slots, K] (tp_now: the slots' true positions, None when
    cells are positions): the slots' other tokens go to ``store``."""
    g = g or geometry(llm)
    if tp_now is None:
        tp_now = true_positions(llm)
    held = tp_now >= 0
    held[np.arange(g.n_slots)[:, None], cells] = False
    gone = [np.flatnonzero(h).astype(np.int32) for h in held]
    if not gone[0].size:
        return
    k, v = read_cells(llm, gone, g, buffers=True)      # every slot loses as many tokens: [S, m, width] as read
    m = gone[0].size
    store.add(np.stack([tp_now[s][gone[s]] for s in range(g.n_slots)]),
              k.reshape(g.n_slots, m, -1), v.reshape(g.n_slots, m, -1))


class Recall:
    """Observes decoded tokens (``observe``, an Observation handler with window 1), swaps stored
    pages into the cache (``step`` every ``every`` tokens, ``turn`` at a new turn)."""

    def __init__(self, config: RecallConfig, eviction):
        """``eviction``: a callable giving the EvictionConfig in force (its page size, and its protected
        pages - sinks, recent - that are never displaced)."""
        self.config, self._eviction = config, eviction
        self.page = config.page_size
        self.store: Store | None = None
        self.steps: list[tuple] = []          # per observed token: (queries [L, H, d], its true position, its
                                              # attention over the compacted cells [S, r, n_keep] or None: a view
                                              # of _att, whose column i is step i's)
        self._att = None                      # float32 [S, capacity, r, n_keep]: the steps' attention, already in
                                              # the layout the recall reads (no stacking at a recall)
        self.n_keep = 0                       # compacted cells after the last eviction (set by the runtime)
        self.n_at_eviction = 0                # logical length at the last eviction
        self.recalled = 0                     # tokens brought back, all slots together
        self.n_recalls = 0
        self.drafted = 0                      # tokens drafted at turns to drive a recall (turn_draft), then removed
        self.held: tuple | None = None        # hold_draft: the last turn's draft queries [L, k, H, d], positions [k]
        self.n_from_decode = 0                # decoding recalls on the decode's own attention (not computed again)
        self._keys = None                     # float32 [S, n_keep, d]: the compacted cells' keys, kept
        self._keys_pos = None                 # between recalls, and the true positions they were read for [S, n_keep]

    @property
    def eviction(self):
        return self._eviction()

    # --- eviction -----------------------------------------------------------------

    def _new_store(self, g) -> Store:
        # a store page is whole eviction pages: what leaves and comes back keeps every buffer made of whole
        # pages, which the next eviction selects from
        P = self.eviction.page_size
        self.page = -(-self.config.page_size // P) * P
        return new_store(g, self.page, self.config.directory)

    def on_evict(self, llm, tp_now: np.ndarray | None, cells: np.ndarray) -> None:
        """Before a compaction that keeps ``cells`` [n_slots, K] (tp_now: the slots' true positions,
        None when cells are positions): the slots' other tokens go to the store."""
        g = geometry(llm)
        self.n_at_eviction = g.pos_max + 1
        if self.store is None:
            self.store = self._new_store(g)
        self.steps.clear()
        self.held = None
        self._keys = self._keys_pos = None    # compaction moves the cells
        self._att = None                      # and changes n_keep
        set_aside(llm, self.store, tp_now, cells, g)

    def reset(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store, self.steps, self.n_keep, self.n_at_eviction = None, [], 0, 0
        self.held = None
        self._keys = self._keys_pos = None
        self._att = None

    # --- sessions -------------------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """The store as arrays (what a saved session keeps); the digests are recomputed on load."""
        st = self.store
        if st is None or not st.n_tokens:
            return {}
        e = np.broadcast_to(np.arange(st.n_tokens), st.pos.shape)
        si = np.broadcast_to(np.arange(st.pos.shape[0])[:, None], st.pos.shape)
        # the tokens observed since the last recall: a restored session recalls when this one would
        q = np.stack([x[0] for x in self.steps]) if self.steps else np.zeros(0, np.float32)
        out = {"recall_pos": st.pos.copy(), "recall_k": st.k.gather(si, e), "recall_v": st.v.gather(si, e),
               "recall_info": np.array([self.n_keep, self.n_at_eviction], np.int64),
               "recall_q": q, "recall_qpos": np.array([x[1] for x in self.steps], np.int64)}
        if self.steps and all(x[2] is not None for x in self.steps):      # their attention as the decode computed it
            L, H = q.shape[1], q.shape[2]
            out["recall_rows"] = np.stack([x[2].reshape(L, H, -1) for x in self.steps])     # [steps, L, H, n_keep]
        if self.held is not None:
            out["recall_hq"], out["recall_hpos"] = self.held[0].copy(), self.held[1].astype(np.int64)
        return out

    def load(self, llm, a: dict) -> None:
        """Restore a store saved by ``arrays`` into this (emptied) recall, for ``llm``'s cache;
        ValueError if the arrays do not fit it."""
        self.reset()
        if not a:
            return
        g = geometry(llm)
        pos, k, v, info = (np.asarray(a[x]) for x in ("recall_pos", "recall_k", "recall_v", "recall_info"))
        q = np.asarray(a["recall_q"])
        qpos = np.asarray(a["recall_qpos"]) if "recall_qpos" in a else None     # None: saved by an older version
        n_steps = q.shape[0] if q.ndim == 4 and qpos is not None else 0
        if n_steps and (qpos.shape != (n_steps,) or q.shape[1] != g.n_layers or qpos.min() < 0
                        or qpos.max() > g.pos_max):
            raise ValueError("its recall store's observed steps do not fit this cache")
        rows = np.asarray(a["recall_rows"], np.float32) if "recall_rows" in a else None
        if rows is not None and (rows.ndim != 4 or rows.shape[:3] != q.shape[:3] or info.shape != (2,)
                                 or rows.shape[3] != int(info[0])):
            raise ValueError("its recall store's observed attention does not fit this cache")
        held = None
        if "recall_hq" in a:
            held = (np.asarray(a["recall_hq"], np.float32), np.asarray(a["recall_hpos"], np.int64))
            if held[0].ndim != 4 or held[0].shape[0] != g.n_layers or held[1].shape != (held[0].shape[1],):
                raise ValueError("its recall store's held draft does not fit this cache")
        store = self._new_store(g)
        M = pos.shape[-1] if pos.ndim == 2 else -1
        if (pos.ndim != 2 or pos.shape[0] != g.n_slots or k.shape != (g.n_slots, M, store.k.width)
                or v.shape != (g.n_slots, M, store.v.width) or info.shape != (2,) or int(info[0]) != g.n_compacted
                or (M and (pos.min() < 0 or pos.max() > g.pos_max))):
            store.close()
            raise ValueError("its recall store does not fit this cache")
        store.add(pos.astype(np.int32), np.ascontiguousarray(k, np.uint8), np.ascontiguousarray(v, np.uint8))
        self.store = store
        self.n_keep, self.n_at_eviction = int(info[0]), int(info[1])
        self.steps = [(q[i], int(qpos[i]), None) for i in range(n_steps)]
        if rows is not None and n_steps:
            self._keep_rows(n_steps, rows.transpose(1, 2, 0, 3), g.n_slots)     # [L, H, steps, n_keep]
        if held is not None and self.config.hold_draft:
            self.held = held

    # --- generation -----------------------------------------------------------------

    def observe(self, view: WindowScores) -> None:
        """Inside llama_decode, for a decoded token (the decode observer): keep its queries, its position
        and, where the decode handed them over, its attention over the compacted cells (``view.rows``). The
        attention is kept while every step since the last recall has it, on a cache of floats (a quantized
        K rounds the decode's queries too coarsely for the log-sum-exp taken from it), and within
        ROWS_BYTES; otherwise the recall computes it."""
        if view.queries is None or self.n_keep == 0:
            return
        rows, n = view.rows, self.n_keep
        had = bool(self.steps) and self.steps[-1][2] is not None        # the steps have it all, or none of them
        keep = (rows is not None and rows.shape[2] >= n and self.store is not None
                and self.store.type_k in ("f32", "f16", "bf16") and (had or not self.steps)
                and (len(self.steps) + 1) * rows.shape[0] * rows.shape[1] * n * 4 <= ROWS_BYTES)
        if had and not keep:
            self.steps = [(q, p, None) for q, p, _ in self.steps]        # no longer of use
            self._att = None
        self.steps.append((view.queries[:, -1].copy(), int(view.pos_last), None))
        if keep:
            self._keep_rows(1, rows[:, :, None, :n], self.store.pos.shape[0])

    def _keep_rows(self, m: int, rows: np.ndarray, S: int) -> None:
        """The attention rows [L, H, m, n_keep] of the last m steps, written into _att (grown as needed) and
        given to those steps as views."""
        L, H, _, n = rows.shape
        r = H // (S // L)
        i = len(self.steps) - m
        att = self._att
        if i and (att is None or att.shape[0] != S or att.shape[2:] != (r, n)):   # (the earlier steps' are not of
            self.steps = [(q, p, None) for q, p, _ in self.steps]                 # this layout: none is kept)
            self._att = None
            return
        if att is None or att.shape[1] < i + m:
            fit = max(1, ROWS_BYTES // (S * r * n * 4))          # steps whose attention is kept at most
            cap = max(i + m, min(max(self.config.every, 2 * (0 if att is None else att.shape[1])), fit))
            new = np.empty((S, cap, r, n), np.float32)
            if i:                   # the earlier steps' rows (each of them has its attention) move over
                new[:, :i] = att[:, :i]
            att = self._att = new
        att[:, i: i + m] = rows.reshape(S, r, m, n).transpose(0, 2, 1, 3)
        self.steps[:] = [(q, p, att[:, j]) for j, (q, p, _) in enumerate(self.steps)]   # all: the buffer may be new

    def due(self) -> bool:
        return self.store is not None and self.store.n_tokens > 0 and len(self.steps) >= self.config.every

    def step(self, llm) -> int:
        """One recall from the decoded tokens observed since the last; returns the tokens brought
        back (all slots together)."""
        steps, self.steps = self.steps, []
        if not steps:
            return 0
        q, qpos = np.stack([x[0] for x in steps], 1), np.array([x[1] for x in steps])
        # the decode's own attention of every step, where each has it (else it is computed below, exactly)
        att = None
        if self._att is not None and all(x[2] is not None and x[2].base is self._att for x in steps):
            att = self._att[:, : len(steps)]
        if self.held is not None:          # hold_draft: the draft's queries for the answer tokens not decoded yet
            hq, hpos = self.held
            ahead = hpos > qpos.max()
            if ahead.any():                # their attention is computed; the decoded steps keep theirs
                q, qpos = np.concatenate([q, hq[:, ahead]], 1), np.concatenate([qpos, hpos[ahead]])
            else:
                self.held = None
        return self._exact(llm, q, qpos, self.config.pages, att)

    def hold(self, queries: np.ndarray, pos_last: int) -> None:
        """hold_draft: keep a turn's draft queries (float32 [L, k, H, d], the last at ``pos_last``) for the
        decoding recalls of the answer's first k tokens."""
        if self.config.hold_draft:
            k = queries.shape[1]
            self.held = (queries, pos_last - k + 1 + np.arange(k))

    def turn(self, llm, queries: np.ndarray, pos_last: int) -> int:
        """A recall at a new turn, for its observed window's queries (float32 [L, w, H, d], the last
        at position ``pos_last``); ``turn_pages`` pages are offered per buffer. Returns the tokens
        brought back."""
        self.steps.clear()
        self.held = None
        if queries is None:
            return 0
        I = queries.shape[1]
        return self._exact(llm, queries, pos_last - I + 1 + np.arange(I), self.config.turn_pages)

    def _exact(self, llm, queries: np.ndarray, qpos: np.ndarray, n_pages: int, att_dec: np.ndarray | None = None) -> int:
        """A recall for queries float32 [L, I, H, d] at true positions qpos [I]: their attention over
        the cache, as the decode computed it for the first D queries (``att_dec`` float32 [S, D, r, n_keep],
        their attention over the compacted cells) and computed here exactly from every held key for the
        others (causal by true position), then ``n_pages`` pages are offered per buffer."""
        g = self._ready(llm)
        if g is None:
            return 0
        L, I, H, d = queries.shape
        S, G = g.n_slots, g.n_slots // g.n_layers
        r = H // G
        # per slot [S, I, r, d]: a slot's query heads are consecutive (slot l * G + j reads heads j * r .. j * r + r - 1)
        qs = np.ascontiguousarray(np.asarray(queries, np.float32).reshape(L, I, G, r, d).transpose(0, 2, 1, 3, 4)
                                  ).reshape(S, I, r, d)
        n = self.n_keep
        tp = true_positions(llm)
        D, lse_dec = 0, None
        if att_dec is not None:
            q_dec = qs[:, : att_dec.shape[1]]                                 # [S, D, r, d]
            lse_dec = self._decoded_lse(llm, g, q_dec, att_dec, tp)
            if lse_dec is not None:
                D = att_dec.shape[1]
                self.n_from_decode += 1
        if D == I:
            return self._swap(llm, g, tp[:, :n], lambda ss: (q_dec[ss[0]: ss[-1] + 1], att_dec[ss[0]: ss[-1] + 1],
                                                             lse_dec[ss[0]: ss[-1] + 1], None), I * r, n_pages, n)
        held = tp >= 0
        col = np.flatnonzero(held.any(0))
        if held[:, col].all():          # the usual case: every slot holds the same cells (a token fills one cell in all)
            cells, held_pos = np.broadcast_to(col.astype(np.int32), (S, col.size)), tp[:, col]
        else:
            cells = np.stack([np.flatnonzero(h) for h in held]).astype(np.int32)        # [S, held]: the same count
            held_pos = np.take_along_axis(tp, cells, 1)                              # compacted cells first
        resident = self._resident_keys(llm, g, tp)
        later = None                    # the keys of the cells written since the eviction: read now
        if cells.shape[1] > n:
            k, _ = read_cells(llm, list(cells[:, n:]), g, buffers=True, keys_only=True)
            later = self.store.keys(k.reshape(S, cells.shape[1] - n, -1))

        # causality by true position: only the cells some query must not see need a mask (the compacted cells
        # precede every query; the cells written since hold the queries' own tokens)
        qc = qpos[D:]                   # the queries whose attention is computed
        late = np.flatnonzero((held_pos > qc.min()).any(0))
        late_seen = held_pos[:, late][:, None, :] <= qc[None, :, None]             # [S, I - D, late]

        n_all = cells.shape[1]

        def inputs(ss):                 # _swap plans slots in contiguous runs a..b-1
            a, b = int(ss[0]), int(ss[-1]) + 1
            q = qs[a:b]                                                         # [s, I, r, d]
            logit = np.empty((b - a, I, r, n_all), np.float32)                  # the first D: the decode's attention
            lc = logit.reshape(b - a, I * r, n_all)[:, D * r:]                   # a view: the computed queries' logits
            q2 = q[:, D:].reshape(b - a, (I - D) * r, -1)
            np.matmul(q2, resident[a:b].transpose(0, 2, 1), out=lc[..., :n])
            if later is not None:
                np.matmul(q2, later[a:b].transpose(0, 2, 1), out=lc[..., n:])
            lc = logit[:, D:]
            if late.size:
                lc[..., late] = np.where(late_seen[a:b, :, None, :], lc[..., late], -np.inf)
            # the softmax in place (in C): the compacted cells (0..n_keep-1) precede every query, so each row has a
            # finite max
            lse, inv = (x.reshape(b - a, I - D, r) for x in softmax_rows(logit.reshape(b - a, I * r, n_all)[:, D * r:]))
            if not D:       # the attention over the compacted cells: these values times 1 / total (the plan multiplies)
                return q, logit[..., :n], lse, inv
            logit[:, :D, :, :n] = att_dec[a:b]
            scale = np.ones((b - a, I, r), np.float32)                           # the decode's attention as it is
            scale[:, D:] = inv
            return q, logit[..., :n], np.concatenate([lse_dec[a:b], lse], 1), scale
        return self._swap(llm, g, tp[:, :n], inputs, I * r, n_pages, n_all)

    def _decoded_lse(self, llm, g, q: np.ndarray, att: np.ndarray, tp: np.ndarray) -> np.ndarray | None:
        """float32 [S, D, r]: the log-sum-exp over the cache of the queries q [S, D, r, d], from their attention
        as the decode computed it (att [S, D, r, n_keep], the softmax over the whole cache restricted to the
        compacted cells): a query's logit of the cell it attends most, minus the log of that attention. None
        where a query has no attention on the compacted cells."""
        S = q.shape[0]
        top = att.argmax(-1)                                                                  # [S, D, r]
        p_top = np.take_along_axis(att, top[..., None], -1)[..., 0]
        resident = self._resident_keys(llm, g, tp)                                            # [S, n_keep, d]
        k_top = resident[np.arange(S)[:, None, None], top]                                       # [S, D, r, d]
        logit = np.einsum("sird,sird->sir", q, k_top)
        with np.errstate(divide="ignore"):
            lse = (logit - np.log(p_top)).astype(np.float32)
        return lse if np.isfinite(lse).all() else None

    def _resident_keys(self, llm, g, tp: np.ndarray) -> np.ndarray:
        """float32 [S, n_keep, d]: the keys of the compacted cells,
        read once after an eviction and kept up to date by the swaps (read again if their true positions
        are not the ones kept)."""
        now = tp[:, : self.n_keep]
        if self._keys is None or not np.array_equal(self._keys_pos, now):
            k, _ = read_cells(llm, [np.arange(self.n_keep, dtype=np.int32)] * g.n_slots, g, buffers=True,
                              keys_only=True)
            k = k.reshape(g.n_slots, self.n_keep, -1)
            self._keys = self.store.keys(k)
            self._keys_pos = now.copy()
        return self._keys

    def _ready(self, llm):
        """The geometry when a recall can run (a store, the compacted layout of the last eviction), else None."""
        st = self.store
        if st is None or not st.n_tokens or self.n_keep == 0:
            return None
        g = geometry(llm)
        return g if g.n_compacted == self.n_keep else None

    def _swap(self, llm, g, tp: np.ndarray, inputs, n_queries: int, n_pages: int, held: int) -> int:
        """Plan every slot's swaps, a few slots at a time (their temporaries bounded by CHUNK_BYTES);
        ``tp`` [S, n_keep]: the compacted cells' true positions; ``held``: the cells the queries attend per slot.
        ``inputs(ss)`` gives slots ss's queries [s, I, r, d], their attention over the compacted cells
        [s, I, r, n_keep] up to a scale, their log-sum-exp over the cache [s, I, r] and that scale [s, I, r]
        (the attention is the product). Then move the rows: displaced
        tokens read out, stored ones written in, the store updated."""
        st = self.store
        P = self.eviction.page_size
        protect = np.zeros(max(int(tp.max()) + 1, self.n_at_eviction) // P + 2, bool)
        protect[[p for p in self.eviction.protected(self.n_at_eviction)]] = True     # sinks and recent pages
        # a slot's temporaries: its queries' attention over the held cells (and a dense copy where the plan needs
        # one), the read pages' keys and their weights (the digests' ranking and the decision, in C, keep theirs
        # per call)
        per_slot = 4 * n_queries * (2 * held + 2 * n_pages * self.page) + 4 * n_pages * self.page * st.head_dim
        chunk = max(1, CHUNK_BYTES // max(per_slot, 1))
        runs = [np.arange(a, min(a + chunk, g.n_slots)) for a in range(0, g.n_slots, chunk)]
        cells, si, e, kf_old = [], [], [], []
        for ss in runs:
            q, att, lse, scale = inputs(ss)
            c, i, j, k = plan(st, ss, q, att, lse, tp[ss], protect, P, n_pages, scale)
            cells += c
            if i.size:
                si.append(i), e.append(j), kf_old.append(k)
        if not si:
            return 0
        si, e, kf_old = np.concatenate(si), np.concatenate(e), np.concatenate(kf_old)
        pos_in = st.pos[si, e]
        # every slot's in turn: the stored rows written, the displaced tokens' rows read out in the same pass
        out_k, out_v = swap_cells(llm, cells, pos_in, st.k.gather(si, e), st.v.gather(si, e), g)
        cs, cc = np.repeat(np.arange(len(cells)), [c.size for c in cells]), np.concatenate(cells)
        out_k, out_v = out_k.reshape(si.size, -1), out_v.reshape(si.size, -1)
        kf_out = st.keys(out_k)                          # the displaced keys as floats [n, d] (as _keys holds them)
        at = cs * self.n_keep + cc                       # the resident keys follow the swap (a flat row index)
        self._keys.reshape(-1, st.head_dim)[at], self._keys_pos.reshape(-1)[at] = kf_old, pos_in
        st.replace(si, e, tp[cs, cc], out_k, out_v, kf_old, kf_out)
        self.recalled += int(si.size)
        return int(si.size)


def _dot(q: np.ndarray, k: np.ndarray, dtype=np.float64) -> np.ndarray:
    """q [S, I, r, d] . k [S, n, d] -> [S, I, r, n] in ``dtype``, as one batched matrix product."""
    S, I, r, d = q.shape
    q = q.reshape(S, I * r, d).astype(dtype, copy=False)
    return np.matmul(q, k.astype(dtype, copy=False).transpose(0, 2, 1)).reshape(S, I, r, -1)


CHUNK_BYTES = 16 << 20      # a recall's temporaries per group of slots planned together
ROWS_BYTES = 64 << 20       # the decoded steps' attention kept between two recalls (about 9 MiB on Qwen2.5 at 8k)


def plan(st: Store, ss: np.ndarray, q: np.ndarray, att: np.ndarray, lse_res: np.ndarray, tp: np.ndarray,
         protect: np.ndarray, P: int, N: int, att_scale: np.ndarray | None = None):
    """The swaps of slots ``ss`` (S of them), all at once.

    q [S, I, r, d] the queries; att [S, I, r, n_keep] their attention over the compacted cells (times
    att_scale [S, I, r] when given), whose true positions are tp [S, n_keep]; lse_res [S, I, r] their
    log-sum-exp over the cache; protect [eviction pages] the pages never displaced; P the eviction's
    page size; N the pages read per slot. Per slot: the digests rank the stored pages by the mass their mean key would get (at most 1 per
    query and head); the top N are read and scored exactly against the cache (their mass and the
    resident tokens' after renormalising over both); in that order, a page comes in while its mass
    beats that of the least attended whole, unprotected eviction pages it displaces (this last part
    in C: bindings.recall_plan). Returns (cells: per slot int32 [n_s], the cells to overwrite; si, e: the store entries coming
    in, in the same order; kf: their keys as floats)."""
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
