"""Metrics of one eviction: union overhead, intra-group disagreement, page accounting,
per-head entropies, weights, sink mass and masquerade ratios.

``head_pages`` [L, H, N]: the page set each query head would keep alone; groups are
r consecutive heads.
"""
from __future__ import annotations

from itertools import combinations

import numpy as np


def _membership(head_pages: np.ndarray, n_pages: int) -> np.ndarray:
    L, H, _ = head_pages.shape
    m = np.zeros((L, H, n_pages), dtype=bool)
    li, hi, _ = np.indices(head_pages.shape)
    m[li, hi, head_pages] = True
    return m


def uor(head_pages: np.ndarray, r: int, n_pages: int | None = None) -> np.ndarray:
    """[L, G]: |union of the group's head sets| / N."""
    L, H, N = head_pages.shape
    n_pages = int(head_pages.max()) + 1 if n_pages is None else n_pages
    m = _membership(head_pages, n_pages).reshape(L, H // r, r, n_pages)
    return m.any(axis=2).sum(axis=-1) / N


def disagreement(head_pages: np.ndarray, r: int, n_pages: int | None = None) -> np.ndarray:
    """[L, G]: mean over head pairs h < h' of the group of 1 - |K_h & K_h'| / N (0 if r = 1)."""
    L, H, N = head_pages.shape
    n_pages = int(head_pages.max()) + 1 if n_pages is None else n_pages
    m = _membership(head_pages, n_pages).reshape(L, H // r, r, n_pages).astype(np.int32)
    pairs = list(combinations(range(r), 2))
    if not pairs:
        return np.zeros((L, H // r))
    inter = np.stack([(m[:, :, a] & m[:, :, b]).sum(axis=-1) for a, b in pairs], axis=-1)
    return (1.0 - inter / N).mean(axis=-1)


def summary(values: np.ndarray) -> dict:
    return {"mean": float(values.mean()), "max": float(values.max()), "count": int(values.size)}
