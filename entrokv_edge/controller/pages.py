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


def select_pages(pi: np.ndarray, N: int, protected, available: np.ndarray | None = None) -> np.ndarray:
    """int32 [..., N], ascending: the protected pages plus the highest-scoring others,
    ties broken by lower page index. Every row keeps exactly N pages. ``available``
    (bool, broadcastable to pi) limits each row to the pages it still holds.

    O(n_pages) per row: a partition finds the N-th largest key; pages above it are kept,
    and of the pages equal to it, the lowest-indexed fill the rest."""
    n_pages = pi.shape[-1]
    prot = np.zeros(n_pages, dtype=bool)
    prot[list(protected)] = True
    if N < prot.sum() or N > n_pages:
        raise ValueError(f"cannot keep {N} pages: {int(prot.sum())} are protected, {n_pages} exist")
    if N == 0:
        return np.zeros((*pi.shape[:-1], 0), dtype=np.int32)
    key = np.where(prot, np.inf, np.asarray(pi, dtype=np.float64))
    if available is not None:
        avail = np.broadcast_to(available, key.shape)
        if (avail.sum(axis=-1) < N).any():
            raise ValueError(f"cannot keep {N} pages: some rows hold fewer")
        key = np.where(avail, key, -np.inf)
    kth = -np.partition(-key, N - 1, axis=-1)[..., N - 1: N]        # the N-th largest key per row
    above = key > kth
    tie = key == kth
    need = N - above.sum(axis=-1, keepdims=True)
    keep = above | (tie & (np.cumsum(tie, axis=-1) <= need))
    return np.nonzero(keep)[-1].reshape(*pi.shape[:-1], N).astype(np.int32)


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
