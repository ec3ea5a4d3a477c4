"""The store: tokens evicted from the cache, kept outside it, per (layer, KV head) slot.

What an eviction takes from a group buffer goes here: its K and V rows in the cache's own types
(in host memory, or in a file read and written with positioned I/O), its true positions, and per
page of true positions the mean of its keys (the digest the recall ranks pages by). The recall
(runtime/recall/) swaps its pages back into the cache; a reselect (runtime/reselect.py) reads its
rows at the eviction after a prompt read in pieces.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from ..bindings import digest_update, geometry, read_cells, rows_to_float, true_positions


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


def set_aside(llm, store: Store, tp_now: np.ndarray | None, cells: np.ndarray, g=None,
              max_bytes: int | None = None) -> int:
    """Before a compaction that keeps ``cells`` [n_slots, K] (tp_now: the slots' true positions, None when
    cells are positions): the slots' other tokens go to ``store``; with ``max_bytes``, only while its rows
    stay within it (the tokens beyond are dropped for good, as without a store). Returns the tokens per slot
    dropped so."""
    g = g or geometry(llm)
    if tp_now is None:
        tp_now = true_positions(llm)
    held = tp_now >= 0
    held[np.arange(g.n_slots)[:, None], cells] = False
    gone = [np.flatnonzero(h).astype(np.int32) for h in held]
    if not gone[0].size:
        return 0
    m = gone[0].size
    if max_bytes is not None and store.nbytes()["rows"] + m * g.n_slots * (store.k.width + store.v.width) > max_bytes:
        return m
    k, v = read_cells(llm, gone, g, buffers=True)      # every slot loses as many tokens: [S, m, width] as read
    store.add(np.stack([tp_now[s][gone[s]] for s in range(g.n_slots)]),
              k.reshape(g.n_slots, m, -1), v.reshape(g.n_slots, m, -1))
    return 0
