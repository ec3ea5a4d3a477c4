"""Eviction policies: each turns window scores into the pages every group buffer keeps.

All run through the same path (page selection, then one physical compaction).
Input ``s`` [L, H, n]: mean attention of the observation window over key positions.
Output pages [L, G, N'] (ascending) with N' = N for every policy but head-independent,
which keeps the union of its heads' choices padded to the largest union.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import numpy as np

from .config import EvictionConfig
from .pages import page_scores, select_pages
from .stats import HeadSummary, head_page_dist, head_stats
from .weights import head_weights, pool


@dataclass
class Selection:
    """pages int32 [L, G, N'] (ascending page indices per group), n_budget = N, weights
    [L, H] where the policy has them, the per-head statistics [L, H] they came from, and
    ``head_pages`` int32 [L, H, N]: each query head's own top-N pages (the head-independent
    replay behind the UOR metrics); ``page_scores`` float [L, G, n_pages]: the pooled page scores the
    pages were chosen by (entrokv-edge and the method's scored policies; None for the others)."""

    pages: np.ndarray
    n_budget: int
    weights: np.ndarray | None
    stats: HeadSummary = field(repr=False)
    head_pages: np.ndarray = field(repr=False)
    page_scores: np.ndarray | None = field(default=None, repr=False)


def _token_page_max(x: np.ndarray, P: int) -> np.ndarray:
    return page_scores(x, P, "max")


_POOL_CHUNK = 1 << 18     # float64 elements max_pool works on at once (2 MiB), so its copies stay small


def max_pool(s: np.ndarray, k: int, fixed: np.ndarray | None = None, spread: int = 0,
             decay: float = 1.0) -> np.ndarray:
    """[..., n]: the maximum of s over the window [i - k//2 - spread, i + k//2] of each key i
    (k odd, 0 or 1: no centred part; the window is cut at the ends), where a key j before
    i - k//2 counts at decay ** (i - k//2 - j) of its score: with spread 0, the k positions
    centred on the key. Keys where ``fixed`` [n] (bool) is set (the sinks and the protected
    pages) neither spread into their neighbours nor change. Works on a few rows of s at a
    time: besides the result, memory stays within a few chunks of _POOL_CHUNK elements."""
    h = k // 2 if k > 1 else 0
    if h == 0 and spread == 0:
        return s
    s = np.asarray(s)
    n = s.shape[-1]
    flat = s.reshape(-1, n)
    out = np.empty(flat.shape, dtype=np.float64)
    step = max(1, _POOL_CHUNK // max(n, 1))
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


def select(s: np.ndarray, r: int, cfg: EvictionConfig, n: int | None = None, *,
           available: np.ndarray | None = None, n_keep: int | None = None,
           values: np.ndarray | None = None) -> Selection:
    """Run ``cfg.policy`` on window scores s [L, H, n] of a GQA model with group ratio r.

    available [L, G, n_pages] (bool): pages each group buffer still holds (after an
    earlier eviction); None: all. n_keep: pages to keep instead of the budget's N.
    values [L, G, n]: the norm of each position's value vector per group buffer, needed
    (only) when cfg.value_power > 0: the scores are then value_weighted before anything else.
    Scores are attention weights: a NaN, infinite or negative one raises ValueError (as the C
    selector refuses it); an all-zero head counts as uniform over the non-sink positions."""
    s = np.asarray(s)
    if s.dtype not in (np.float32, np.float64):
        s = s.astype(np.float64)
    if s.size and not (s.min() >= 0 and np.isfinite(s.max())):     # min and max are NaN if any score is
        raise ValueError(f"window scores must be finite and >= 0 (attention weights); these range over "
                         f"[{s.min()}, {s.max()}]")
    if cfg.value_power > 0:
        if values is None:
            raise ValueError("value_power needs the value norms (values [L, G, n])")
        s = value_weighted(s, values, r, cfg.value_power)
    L, H, n_s = s.shape
    n = n_s if n is None else n
    if H % r:
        raise ValueError(f"{H} query heads do not split into groups of {r}")
    G = H // r
    P, mode = cfg.page_size, cfg.page_score
    N = cfg.budget_pages(n) if n_keep is None else n_keep
    prot = cfg.protected(n)
    n_pages = cfg.n_pages(n)
    if cfg.policy == "full" and available is not None and not available.all():
        raise ValueError("the full policy cannot run on a cache that was already evicted")
    avail_heads = None if available is None else np.repeat(available, r, axis=1)
    st = head_stats(s, cfg.sinks, P, keep_all=cfg.policy == "no-isolation")   # only its page scores use page_all
    summary = st.summary()
    k = min(cfg.sinks, n)

    def token_dist(isolated: bool, x: np.ndarray, xs) -> np.ndarray:
        """[L, H, n] head distributions of x (only the max page score needs them)."""
        if not isolated:
            return x / np.where(xs.mass_all > 0, xs.mass_all, 1.0)[..., None]
        p = x / np.where(xs.flagged, 1.0, xs.mass_iso)[..., None]
        p[..., :k] = 0.0
        if xs.flagged.any():
            p[xs.flagged] = np.where(np.arange(n) < k, 0.0, 1.0 / max(n - k, 1))
        return p

    # each query head's own top-N pages (the head-independent replay behind the UOR metrics, and that
    # policy's union), taken first: the raw scores' page sums can then go before pooled ones are made
    own = head_page_dist(st) if mode == "sum" else _token_page_max(token_dist(True, s, st), P)
    head_pages = select_pages(own, N, prot, avail_heads)
    mean = None
    if cfg.policy == "head-independent":
        mean = np.einsum("lgrp->lgp", (own if mode == "sum" else head_page_dist(st)).reshape(L, G, r, n_pages)) / r
    del own
    # entrokv-edge's pooling: pages are scored from the pooled scores, the weights from the raw ones
    fixed = None
    smooth = cfg.pool > 1 or cfg.spread > 0
    if smooth or cfg.entropy_region == "evictable":
        fixed = np.zeros(n_s, dtype=bool)             # keys every buffer keeps: the protected pages (sinks included)
        for j in prot:
            fixed[j * P: (j + 1) * P] = True
    if smooth:
        st = None                                     # from here the pooled scores' sums stand in for the raw ones

    def page_dist(isolated: bool) -> np.ndarray:
        """[L, H, n_pages]: each head's distribution of the (pooled) scores summed per page; pooled
        one layer at a time."""
        return pooled_page_dist(s, cfg, fixed, isolated) if smooth else head_page_dist(st, isolated)

    def proj_token_dist(isolated: bool) -> np.ndarray:
        """[L, H, n]: token_dist of the (pooled) scores."""
        if not smooth:
            return token_dist(isolated, s, st)
        x = max_pool(s, cfg.pool, fixed, cfg.spread, cfg.decay)
        return token_dist(isolated, x, head_stats(x, cfg.sinks, P))

    w, pi = None, None
    if cfg.policy == "full":
        pages = np.broadcast_to(np.arange(n_pages, dtype=np.int32), (L, G, n_pages)).copy()
    elif cfg.policy == "streaming":
        pages = select_pages(np.broadcast_to(np.arange(n_pages, dtype=np.float64), (L, G, n_pages)), N, prot, available)
    elif cfg.policy in ("page-entrokv", "no-isolation", "mean-pool", "entrokv-edge"):
        isolated = cfg.policy != "no-isolation"
        if cfg.head_pool == "entropy":      # weights only where a weighted sum uses them
            c = summary.c_iso if isolated else summary.c_all
            if cfg.entropy_region == "evictable":
                c = evictable_collision(s, ~fixed)
            w = np.full((L, H), 1.0 / r) if cfg.policy == "mean-pool" else head_weights(c, r, cfg.tau)
        if cfg.head_pool != "entropy":      # entrokv-edge: the group's heads pooled by max or by rank
            hd = page_dist(isolated) if mode == "sum" else _token_page_max(proj_token_dist(isolated), P)
            pi = group_pool(hd.reshape(L, G, r, n_pages), cfg.head_pool, prot)
            del hd
        elif mode == "sum":
            pi = np.einsum("lgrp,lgr->lgp", page_dist(isolated).reshape(L, G, r, n_pages), w.reshape(L, G, r))
        else:
            pi = _token_page_max(pool(proj_token_dist(isolated), w, r), P)
        if cfg.consensus > 0:
            m = math.floor(cfg.consensus * (N - len(prot)) + 1e-9)
            prot = sorted(set(prot) | set(consensus_pages(pi, m, prot, available)))
        pages = select_pages(pi, N, prot, available)
    elif cfg.policy == "max-pool":
        pages = select_pages(page_scores(s.reshape(L, G, r, n_s).max(axis=2), P, mode), N, prot, available)
    elif cfg.policy == "head-independent":
        pages = union_padded(head_pages, mean if available is None else np.where(available, mean, -np.inf))
    else:  # guarded by EvictionConfig
        raise ValueError(cfg.policy)
    return Selection(pages=pages, n_budget=N, weights=w, stats=summary, head_pages=head_pages, page_scores=pi)


def select_layers(layer_scores: Callable[[int], np.ndarray], L: int, r: int, cfg: EvictionConfig, n: int, *,
                  available: np.ndarray | None = None, n_keep: int | None = None,
                  values: np.ndarray | None = None) -> Selection:
    """``select`` one layer at a time, the same selection: ``layer_scores(l)`` gives layer l's scores
    [H, n], so what the policy computes on the way (page sums, pooled scores, distributions: several
    arrays the size of s) is one layer's, not L layers' of the logical length n. Two choices span the
    layers: head-independent pads every group's union to the longest over all layers (its scores are
    taken all at once), and consensus (> 0) votes over every (layer, group): the layers' pooled page
    scores are kept (small: [L, G, n_pages]), the vote is taken over them, and each layer's pages are
    chosen again with the agreed pages kept, as the joint selection does."""
    if cfg.policy == "head-independent" or L == 0:
        s = np.stack([layer_scores(l) for l in range(L)]) if L else np.zeros((0, 0, n))
        return select(s, r, cfg, n, available=available, n_keep=n_keep, values=values)
    vote = cfg.policy == "entrokv-edge" and cfg.consensus > 0
    each = replace(cfg, consensus=0.0) if vote else cfg
    parts = []
    for l in range(L):
        part = select(layer_scores(l)[None], r, each, n, n_keep=n_keep,
                      available=None if available is None else available[l: l + 1],
                      values=None if values is None else values[l: l + 1])
        parts.append(part)
    cat = lambda xs: np.concatenate(xs, axis=0)      # noqa: E731
    pages = cat([p.pages for p in parts])
    pi = None if parts[0].page_scores is None else cat([p.page_scores for p in parts])
    if vote:
        N, prot = parts[0].n_budget, cfg.protected(n)
        m = math.floor(cfg.consensus * (N - len(prot)) + 1e-9)
        prot = sorted(set(prot) | set(consensus_pages(pi, m, prot, available)))
        pages = select_pages(pi, N, prot, available)
    w = None if parts[0].weights is None else cat([p.weights for p in parts])
    stats = HeadSummary(*(cat([getattr(p.stats, f.name) for p in parts]) for f in fields(HeadSummary)))
    return Selection(pages=pages, n_budget=parts[0].n_budget, weights=w, stats=stats,
                     head_pages=cat([p.head_pages for p in parts]), page_scores=pi)


def union_padded(heads: np.ndarray, score: np.ndarray) -> np.ndarray:
    """[L, G, U]: per group the union of its heads' pages (heads [L, H, N], r consecutive
    heads per group), padded with the group's next-best pages by ``score`` [L, G, n_pages]
    to the largest union U over all groups, since one shared cell index needs equal lengths."""
    L, G, n_pages = score.shape
    r = heads.shape[1] // G
    member = np.zeros((L, G, n_pages), dtype=bool)
    li, hi, _ = np.indices(heads.shape)
    member[li, hi // r, heads] = True
    U = int(member.sum(axis=-1).max())
    key = np.where(member, np.inf, score)
    order = np.argsort(-key, axis=-1, kind="stable")[..., :U]
    return np.sort(order, axis=-1).astype(np.int32)
