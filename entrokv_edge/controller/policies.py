"""Eviction policies: each turns window scores into the pages every group buffer keeps.

All run through the same path (page selection, then one physical compaction).
Input ``s`` [L, H, n]: mean attention of the observation window over key positions.
Output pages [L, G, N'] (ascending) with N' = N for every policy but head-independent,
which keeps the union of its heads' choices padded to the largest union.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import EvictionConfig
from .pages import page_scores, select_pages
from .weights import collision, head_weights, isolate_sinks, normalize, pool


@dataclass
class Selection:
    pages: np.ndarray            # int32 [L, G, N'] ascending page indices
    n_budget: int                # N: the budget in pages
    head_pages: np.ndarray       # int32 [L, H, N]: each head's own top-N pages (for UOR replay)
    weights: np.ndarray | None   # [L, H] head weights where the policy has them


def head_choices(s: np.ndarray, cfg: EvictionConfig, N: int, protected) -> np.ndarray:
    """[L, H, N]: the pages each query head would keep alone (its own sink-isolated scores)."""
    p, _ = isolate_sinks(s, cfg.sinks)
    return select_pages(page_scores(p, cfg.page_size, cfg.page_score), N, protected)


def select(s: np.ndarray, r: int, cfg: EvictionConfig, n: int | None = None) -> Selection:
    """Run ``cfg.policy`` on window scores s [L, H, n] of a GQA model with group ratio r."""
    s = np.asarray(s, dtype=np.float64)
    L, H, n_s = s.shape
    n = n_s if n is None else n
    if H % r:
        raise ValueError(f"{H} query heads do not split into groups of {r}")
    G = H // r
    N = cfg.budget_pages(n)
    prot = cfg.protected(n)
    heads = head_choices(s, cfg, N, prot)
    P, mode = cfg.page_size, cfg.page_score
    w = None
    if cfg.policy == "full":
        pages = np.broadcast_to(np.arange(cfg.n_pages(n), dtype=np.int32), (L, G, cfg.n_pages(n))).copy()
    elif cfg.policy == "streaming":
        recency = np.broadcast_to(np.arange(cfg.n_pages(n), dtype=np.float64), (L, G, cfg.n_pages(n)))
        pages = select_pages(recency, N, prot)
    elif cfg.policy in ("page-entrokv", "no-isolation", "mean-pool"):
        p = normalize(s) if cfg.policy == "no-isolation" else isolate_sinks(s, cfg.sinks)[0]
        w = np.full((L, H), 1.0 / r) if cfg.policy == "mean-pool" else head_weights(collision(p), r, cfg.tau)
        pages = select_pages(page_scores(pool(p, w, r), P, mode), N, prot)
    elif cfg.policy == "max-pool":
        pages = select_pages(page_scores(s.reshape(L, G, r, n_s).max(axis=2), P, mode), N, prot)
    elif cfg.policy == "head-independent":
        pages = union_padded(heads, s, r, cfg)
    else:  # guarded by EvictionConfig
        raise ValueError(cfg.policy)
    return Selection(pages=pages, n_budget=N, head_pages=heads, weights=w)


def union_padded(heads: np.ndarray, s: np.ndarray, r: int, cfg: EvictionConfig) -> np.ndarray:
    """[L, G, U]: per group the union of its heads' pages, padded with the group's
    next-best pages (mean-pooled score) to the largest union U over all groups, since
    one shared cell index needs equal lengths."""
    L, H, N = heads.shape
    G = H // r
    n_pages = -(-s.shape[-1] // cfg.page_size)
    member = np.zeros((L, G, n_pages), dtype=bool)
    li, hi, _ = np.indices(heads.shape)
    member[li, hi // r, heads] = True
    U = int(member.sum(axis=-1).max())
    p, _ = isolate_sinks(s, cfg.sinks)
    mean = page_scores(pool(p, np.full((L, H), 1.0 / r), r), cfg.page_size, cfg.page_score)
    key = np.where(member, np.inf, mean)
    order = np.argsort(-key, axis=-1, kind="stable")[..., :U]
    return np.sort(order, axis=-1).astype(np.int32)
