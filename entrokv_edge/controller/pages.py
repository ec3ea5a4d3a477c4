"""Projection of token scores onto pages, and exact-budget page selection.

Page j holds positions [jP, (j+1)P); the last page may be partial.
"""
from __future__ import annotations

import numpy as np


def page_scores(S: np.ndarray, P: int, mode: str = "sum") -> np.ndarray:
    """[..., n_pages]: per page, the sum (attention mass) or max of S [..., n] over its tokens."""
    n = S.shape[-1]
    n_pages = -(-n // P)
    pad = n_pages * P - n
    x = np.pad(S, [(0, 0)] * (S.ndim - 1) + [(0, pad)])
    x = x.reshape(*S.shape[:-1], n_pages, P)
    return x.sum(axis=-1) if mode == "sum" else x.max(axis=-1)


_ROWS_CHUNK = 1 << 18      # float64 elements select_pages works on at once (2 MiB): its copies stay small


def select_pages(pi: np.ndarray, N: int, protected, available: np.ndarray | None = None) -> np.ndarray:
    """int32 [..., N], ascending: the protected pages plus the highest-scoring others,
    ties broken by lower page index. Every row keeps exactly N pages. ``available``
    (bool, broadcastable to pi) limits each row to the pages it still holds. NaN scores rank
    below every other score of the pages a row holds.

    O(n_pages) per row: a partition finds the N-th largest key; pages above it are kept,
    and of the pages equal to it, the lowest-indexed fill the rest. Works on a few rows at a
    time: besides the result, memory stays within a few chunks of _ROWS_CHUNK elements."""
    n_pages = pi.shape[-1]
    prot = np.zeros(n_pages, dtype=bool)
    prot[list(protected)] = True
    if N < prot.sum() or N > n_pages:
        raise ValueError(f"cannot keep {N} pages: {int(prot.sum())} are protected, {n_pages} exist")
    lead = pi.shape[:-1]
    if N == 0:
        return np.zeros((*lead, 0), dtype=np.int32)
    rows = np.asarray(pi).reshape(-1, n_pages)
    avail = None
    if available is not None:
        avail = np.broadcast_to(available, pi.shape).reshape(-1, n_pages)
        if (avail.sum(axis=-1) < N).any():
            raise ValueError(f"cannot keep {N} pages: some rows hold fewer")
    out = np.empty((rows.shape[0], N), dtype=np.int32)
    step = max(1, _ROWS_CHUNK // n_pages)
    for a in range(0, rows.shape[0], step):
        key = np.where(prot, np.inf, np.asarray(rows[a: a + step], dtype=np.float64))
        key[np.isnan(key)] = -np.finfo(np.float64).max      # below every score, above the pages a row lacks
        if avail is not None:
            key[~avail[a: a + step]] = -np.inf
        kth = np.partition(key, n_pages - N, axis=-1)[:, n_pages - N: n_pages - N + 1]   # the N-th largest per row
        above = key > kth
        tie = key == kth
        need = N - above.sum(axis=-1, keepdims=True)
        keep = above | (tie & (np.cumsum(tie, axis=-1) <= need))
        out[a: a + step] = np.nonzero(keep)[1].reshape(-1, N)
    return out.reshape(*lead, N)


def pages_to_positions(pages: np.ndarray, P: int, n: int) -> np.ndarray:
    """int32 [..., K]: the token positions of the selected pages (ascending). All rows
    must select the same number of full pages plus the same partial page, which
    protection of the last page guarantees; K is the same for every row."""
    pos = pages[..., :, None] * P + np.arange(P)
    pos = pos.reshape(*pages.shape[:-1], -1)
    valid = pos < n
    counts = valid.sum(axis=-1)
    if counts.size and (counts != counts.flat[0]).any():
        raise ValueError("rows keep different token counts (a partial page is not kept by every row)")
    K = int(counts.flat[0]) if counts.size else 0
    return pos[valid].reshape(*pages.shape[:-1], K).astype(np.int32)
