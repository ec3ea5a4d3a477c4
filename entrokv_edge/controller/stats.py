"""Per-head statistics of window scores in few passes, from which every policy works.

Page-EntroKV's page score is linear in the head distributions, so it needs only each
head's per-page sums of s (sinks excluded), its non-sink mass and its sum of squares:
pi[l, g, j] = sum_h w[l, h] * page_sum[l, h, j] / mass[l, h]. That keeps the work at
two passes over s [L, H, n] and leaves the rest on [L, H, n_pages] arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class HeadStats:
    """page_iso / page_all [L, H, n_pages]: page sums of s without / with the sinks (page_all
    None where head_stats was told not to keep it);
    mass_iso / mass_all [L, H]; c_iso / c_all [L, H]: collision <p, p>; flagged [L, H]:
    heads with no mass outside the sinks (they use the uniform distribution)."""

    page_iso: np.ndarray
    page_all: np.ndarray | None
    mass_iso: np.ndarray
    mass_all: np.ndarray
    c_iso: np.ndarray
    c_all: np.ndarray
    flagged: np.ndarray
    uniform_pages: np.ndarray  # [n_pages]: page sums of the uniform non-sink distribution

    def summary(self) -> "HeadSummary":
        """The [L, H] statistics alone (what outlives a selection)."""
        return HeadSummary(self.mass_iso, self.mass_all, self.c_iso, self.c_all, self.flagged)


@dataclass
class HeadSummary:
    """HeadStats without its page sums: mass_iso / mass_all, c_iso / c_all, flagged, all [L, H]."""

    mass_iso: np.ndarray
    mass_all: np.ndarray
    c_iso: np.ndarray
    c_all: np.ndarray
    flagged: np.ndarray


def _page_sums(s: np.ndarray, P: int) -> np.ndarray:
    """[L, H, n_pages] float64 page sums of s [L, H, n] (float64); the last page may be partial."""
    L, H, n = s.shape
    full = n // P
    out = np.empty((L, H, -(-n // P)))
    if full:
        out[..., :full] = (s[..., : full * P].reshape(-1, P) @ np.ones(P)).reshape(L, H, full)
    if n % P:
        out[..., -1] = s[..., full * P:].sum(axis=-1)
    return out


def head_stats(s: np.ndarray, sinks: int, P: int, keep_all: bool = True) -> HeadStats:
    """Two passes over s [L, H, n] (float32 or float64; accumulated in float64). keep_all
    False: page_all is None (only no-isolation's page scores need it), one [L, H, n_pages]
    array less."""
    s = np.asarray(s, dtype=np.float64)
    L, H, n = s.shape
    k = min(sinks, n)
    page_all = _page_sums(s, P)
    mass_all = page_all.sum(axis=-1)
    page_iso = page_all.copy() if keep_all else page_all
    if not keep_all:
        page_all = None
    for j in range(-(-k // P)):  # pages that hold sinks: their sums without the sink tokens
        page_iso[..., j] = s[..., k: min(n, (j + 1) * P)].sum(axis=-1) if (j + 1) * P > k else 0.0
    mass_iso = page_iso.sum(axis=-1)
    sq_iso = np.einsum("lhn,lhn->lh", s[..., k:], s[..., k:])
    sq_all = sq_iso + np.einsum("lhn,lhn->lh", s[..., :k], s[..., :k])
    flagged = mass_iso <= 0.0
    n_free = max(n - k, 1)
    c_iso = np.where(flagged, 1.0 / n_free, sq_iso / np.where(flagged, 1.0, mass_iso) ** 2)
    c_all = sq_all / np.where(mass_all > 0, mass_all, 1.0) ** 2
    # the uniform distribution's page sums: each page's non-sink tokens (counted exactly) x 1 / n_free, the
    # same number for every full page (summing 1 / n_free P times can round differently per page, and a
    # one-ulp difference broke the tie between pages that the lower index must win, as in C)
    uniform_pages = _page_sums((np.arange(n) >= k).astype(np.float64)[None, None], P)[0, 0] * (1.0 / n_free)

    return HeadStats(page_iso, page_all, mass_iso, mass_all, c_iso, c_all, flagged, uniform_pages)


def head_page_dist(st: HeadStats, isolated: bool = True) -> np.ndarray:
    """[L, H, n_pages]: each head's distribution summed per page."""
    if not isolated:
        return st.page_all / np.where(st.mass_all > 0, st.mass_all, 1.0)[..., None]
    p = st.page_iso / np.where(st.flagged, 1.0, st.mass_iso)[..., None]
    if st.flagged.any():       # in place: no second [L, H, n_pages] array
        p[st.flagged] = st.uniform_pages
    return p
