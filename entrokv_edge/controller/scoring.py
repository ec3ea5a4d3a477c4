"""The scores policies work from: window scores smoothed over key positions, pooled over the heads of
a group, voted on by every (layer, group) buffer, weighted by value norms. Numpy only.

Shapes: s [L, H, n] (mean attention of the observation window over key positions), L layers,
H query heads in groups of r, n_pages pages of P positions.
"""
from __future__ import annotations

import numpy as np

from .config import EvictionConfig
from .stats import head_page_dist, head_stats

POOL_CHUNK = 1 << 18     # float64 elements max_pool works on at once (2 MiB), so its copies stay small


def max_pool(s: np.ndarray, k: int, fixed: np.ndarray | None = None, spread: int = 0,
             decay: float = 1.0, chunk: int = POOL_CHUNK) -> np.ndarray:
    """[..., n]: the maximum of s over the window [i - k//2 - spread, i + k//2] of each key i
    (k odd, 0 or 1: no centred part; the window is cut at the ends), where a key j before
    i - k//2 counts at decay ** (i - k//2 - j) of its score: with spread 0, the k positions
    centred on the key. Keys where ``fixed`` [n] (bool) is set (the sinks and the protected
    pages) neither spread into their neighbours nor change. Works on a few rows of s at a
    time: besides the result, memory stays within a few ``chunk`` elements."""
    h = k // 2 if k > 1 else 0
    if h == 0 and spread == 0:
        return s
    s = np.asarray(s)
    n = s.shape[-1]
    flat = s.reshape(-1, n)
    out = np.empty(flat.shape, dtype=np.float64)
    step = max(1, chunk // max(n, 1))
    for a in range(0, flat.shape[0], step):      # float64 chunk by chunk (a float32 s is not copied whole)
        out[a: a + step] = _max_pool_rows(np.asarray(flat[a: a + step], dtype=np.float64), h, fixed, spread, decay)
    return out.reshape(s.shape)


def _max_pool_rows(s: np.ndarray, h: int, fixed, spread: int, decay: float) -> np.ndarray:
    """max_pool on rows s [m, n] (float64) with half-width h."""
    n = s.shape[-1]
    src = s.copy()
    if fixed is not None:
        src[..., fixed] = 0.0
    cen = src.copy()
    for d in range(1, min(h, n - 1) + 1):             # the centred window: key i takes the scores of i -/+ d
        np.maximum(cen[..., d:], src[..., :-d], out=cen[..., d:])
        np.maximum(cen[..., :-d], src[..., d:], out=cen[..., :-d])
    out = cen.copy()
    for d in range(1, min(spread, n - 1) + 1):        # the spread: key i takes the window of key i - d, discounted
        np.maximum(out[..., d:], cen[..., :-d] * decay ** d, out=out[..., d:])
    if fixed is not None:
        out[..., fixed] = s[..., fixed]
    return out


def pooled_page_dist(s: np.ndarray, cfg: EvictionConfig, fixed: np.ndarray | None, isolated: bool = True) -> np.ndarray:
    """[L, H, n_pages]: head_page_dist of max_pool(s) [L, H, n], one layer at a time: the
    pooled scores and their page sums never exist whole (a copy of s per eviction, 34 MiB for
    SmolLM2 at 16k positions)."""
    out = None
    for l in range(s.shape[0]):
        st = head_stats(max_pool(s[l: l + 1], cfg.pool, fixed, cfg.spread, cfg.decay), cfg.sinks, cfg.page_size,
                        keep_all=not isolated)
        x = head_page_dist(st, isolated)
        if out is None:
            out = np.empty((s.shape[0], *x.shape[1:]), dtype=x.dtype)
        out[l] = x[0]
    return out


def evictable_collision(s: np.ndarray, region: np.ndarray) -> np.ndarray:
    """c [L, H]: collision <p, p> of each head's distribution over the keys in ``region``
    [n] (bool: the keys of pages that may be evicted); uniform where a head has no mass
    there. An empty region falls back to every key."""
    s = np.asarray(s, dtype=np.float64)
    if not region.any():
        region = np.ones(s.shape[-1], dtype=bool)
    x = s[..., region]
    mass = x.sum(axis=-1)
    sq = np.einsum("lhn,lhn->lh", x, x)
    return np.where(mass > 0, sq / np.where(mass > 0, mass, 1.0) ** 2, 1.0 / int(region.sum()))


def group_pool(hd: np.ndarray, how: str, protected=()) -> np.ndarray:
    """[L, G, n_pages] page scores of each group from its heads' page distributions
    hd [L, G, r, n_pages]. "max": the largest share any head gives the page. "rank": the
    best rank any head gives the page among the unprotected ones (every head's first
    choice, then every head's second, ...: the head-independent union, cut to the budget),
    ties broken by the max share. One layer at a time (the sort's copies stay small)."""
    mx = hd.max(axis=2)
    if how == "max":
        return mx
    L, G, r, n_pages = hd.shape
    out = np.empty((L, G, n_pages), dtype=np.float64)
    ranks = np.arange(n_pages, dtype=np.int32)
    for l in range(L):
        key = np.negative(hd[l], dtype=np.float64)      # ascending order of -share: best page first
        key[..., list(protected)] = np.inf
        order = np.argsort(key, axis=-1, kind="stable")
        rank = np.empty(order.shape, dtype=np.int32)
        np.put_along_axis(rank, order, np.broadcast_to(ranks, order.shape), axis=-1)
        out[l] = -rank.min(axis=1)
    return out + 0.5 * mx / (mx.max(axis=-1, keepdims=True) + 1e-300)


def consensus_pages(pi: np.ndarray, m: int, protected, available: np.ndarray | None = None) -> list[int]:
    """The m pages with the highest mean score over every (layer, group) row of pi
    [L, G, n_pages] (each row normalized over its unprotected pages: one vote per buffer),
    among pages every row still holds; ties to the lower index."""
    n_pages = pi.shape[-1]
    free = np.ones(n_pages, dtype=bool)
    free[list(protected)] = False
    if available is not None:
        free &= np.broadcast_to(available, pi.shape).reshape(-1, n_pages).all(axis=0)
    m = min(m, int(free.sum()))
    if m <= 0:
        return []
    x = np.where(free, np.asarray(pi, dtype=np.float64), 0.0).reshape(-1, n_pages)
    tot = x.sum(axis=-1, keepdims=True)
    vote = (x / np.where(tot > 0, tot, 1.0)).mean(axis=0)
    order = np.lexsort((np.arange(n_pages), -np.where(free, vote, -np.inf)))
    return sorted(int(j) for j in order[:m])


def value_weighted(s: np.ndarray, values: np.ndarray, r: int, power: float) -> np.ndarray:
    """s [L, H, n] times values [L, G, n] ** power, each query head h taking its group g = h // r
    (the option value_power: values are the norms of the value vectors each group buffer holds).
    A new array of s's float type; s is not changed."""
    L, H, n = s.shape
    if H % r:
        raise ValueError(f"{H} query heads do not split into groups of {r}")
    values = np.asarray(values)
    if values.shape != (L, H // r, n):
        raise ValueError(f"values must be [L, G, n] = {[L, H // r, n]}, got {list(values.shape)}")
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError("values must be finite norms >= 0")
    f = values.astype(s.dtype) ** s.dtype.type(power)
    return (s.reshape(L, H // r, r, n) * f[:, :, None, :]).reshape(L, H, n)
