"""Eviction policies: window scores in, the pages every group buffer keeps out (numpy only).

A policy is a scorer and a selection. The scorer gives page scores per (layer, KV group),
pi [L, G, n_pages]; the selection (``ExactBudget``) keeps exactly N pages in every group buffer:
the protected pages (sinks, recent) and the highest-scoring others. Two policies are selections of
their own: ``full`` (everything) and ``head-independent`` (the union of each head's own choice, the
baseline whose memory the method saves). Wrappers add behaviour without changing what they wrap:
``Protect`` (more pages every buffer keeps), ``Favour`` (a bonus on given positions).

    policy = policy_for(EvictionConfig(budget=0.2))
    sel = policy.select(s, r)           # s [L, H, n]: mean attention of the window over key positions
    sel.pages                           # int32 [L, G, N], ascending

Output pages [L, G, N'] with N' = N for every policy but head-independent, which keeps the union
of its heads' choices padded to the largest union.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable

import numpy as np

from .config import EvictionConfig
from .pages import page_scores, select_pages
from .scoring import consensus_pages, evictable_collision, group_pool, max_pool, pooled_page_dist, value_weighted
from .stats import HeadStats, HeadSummary, head_page_dist, head_stats
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


class Inputs:
    """One selection's window scores as every policy reads them: checked (attention weights: a NaN,
    infinite or negative score raises ValueError, as the C selector refuses it), weighted by the value
    norms (value_power), with each head's statistics ``st`` and its own top-N pages ``head_pages``.
    ``prot``: the pages every buffer keeps (the policy's ``protected``)."""

    def __init__(self, policy: "Policy", s: np.ndarray, r: int, n: int | None, available, n_keep, values):
        cfg = policy.config
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
        self.cfg, self.s, self.r, self.n, self.n_s, self.L, self.H, self.G = cfg, s, r, n, n_s, L, H, H // r
        self.available = available
        self.N = cfg.budget_pages(n) if n_keep is None else n_keep
        self.prot = policy.protected(n)
        self.n_pages = cfg.n_pages(n)
        policy.check(available)
        avail_heads = None if available is None else np.repeat(available, r, axis=1)
        P = cfg.page_size
        self.st: HeadStats | None = head_stats(s, cfg.sinks, P, keep_all=cfg.policy == "no-isolation")
        self.summary = self.st.summary()
        self.k = min(cfg.sinks, n)
        # each query head's own top-N pages, taken first: the raw scores' page sums can then go before pooled
        # ones are made
        own = head_page_dist(self.st) if cfg.page_score == "sum" else \
            _token_page_max(self.token_dist(True, s, self.st), P)
        self.head_pages = select_pages(own, self.N, self.prot, avail_heads)
        self.head_mean = None           # [L, G, n_pages]: the heads' mean page distribution (head-independent's)
        if policy.wants_head_mean:
            dist = own if cfg.page_score == "sum" else head_page_dist(self.st)
            self.head_mean = np.einsum("lgrp->lgp", dist.reshape(L, self.G, r, self.n_pages)) / r

    def token_dist(self, isolated: bool, x: np.ndarray, xs: HeadStats) -> np.ndarray:
        """[L, H, n] head distributions of x (only the max page score needs them)."""
        n, k = self.n, self.k
        if not isolated:
            return x / np.where(xs.mass_all > 0, xs.mass_all, 1.0)[..., None]
        p = x / np.where(xs.flagged, 1.0, xs.mass_iso)[..., None]
        p[..., :k] = 0.0
        if xs.flagged.any():
            p[xs.flagged] = np.where(np.arange(n) < k, 0.0, 1.0 / max(n - k, 1))
        return p


class Scorer:
    """Page scores per (layer, KV group) from a selection's inputs: ``score(inp)`` -> (pi [L, G, n_pages],
    head weights [L, H] or None). ``reported``: whether the selection reports pi."""

    reported = False

    def score(self, inp: Inputs) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError


class Recency(Scorer):
    """streaming: the latest pages first (with the protected sinks, StreamingLLM)."""

    def score(self, inp):
        return np.broadcast_to(np.arange(inp.n_pages, dtype=np.float64), (inp.L, inp.G, inp.n_pages)), None


class GroupMax(Scorer):
    """max-pool: a page's score is the largest score any head of the group gives its tokens."""

    def score(self, inp):
        s, cfg = inp.s, inp.cfg
        return page_scores(s.reshape(inp.L, inp.G, inp.r, inp.n_s).max(axis=2), cfg.page_size, cfg.page_score), None


class EntropyScorer(Scorer):
    """The method's scores: each group's heads pooled with weights from their sink-isolated collision entropy,
    projected onto pages (page-entrokv; no-isolation: the entropy over every key, sinks included; mean-pool:
    equal weights). entrokv-edge's options on top: the scores smoothed over key positions (pool, spread,
    decay), the heads pooled by rank or max instead (head_pool), the entropy over the evictable keys
    (entropy_region)."""

    reported = True

    def pooled_dist(self, s: np.ndarray, cfg: EvictionConfig, fixed: np.ndarray | None, isolated: bool) -> np.ndarray:
        """[L, H, n_pages]: each head's distribution of the smoothed scores summed per page."""
        return pooled_page_dist(s, cfg, fixed, isolated)

    def score(self, inp):
        cfg, s, r, L, H, G, P = inp.cfg, inp.s, inp.r, inp.L, inp.H, inp.G, inp.cfg.page_size
        fixed = None
        smooth = cfg.pool > 1 or cfg.spread > 0
        if smooth or cfg.entropy_region == "evictable":
            fixed = np.zeros(inp.n_s, dtype=bool)     # keys every buffer keeps: the protected pages (sinks included)
            for j in inp.prot:
                fixed[j * P: (j + 1) * P] = True
        if smooth:
            inp.st = None                             # from here the pooled scores' sums stand in for the raw ones
        st = inp.st

        def page_dist(isolated: bool) -> np.ndarray:
            return self.pooled_dist(s, cfg, fixed, isolated) if smooth else head_page_dist(st, isolated)

        def proj_token_dist(isolated: bool) -> np.ndarray:
            if not smooth:
                return inp.token_dist(isolated, s, st)
            x = max_pool(s, cfg.pool, fixed, cfg.spread, cfg.decay)
            return inp.token_dist(isolated, x, head_stats(x, cfg.sinks, P))

        isolated = cfg.policy != "no-isolation"
        w = None
        if cfg.head_pool == "entropy":      # weights only where a weighted sum uses them
            c = inp.summary.c_iso if isolated else inp.summary.c_all
            if cfg.entropy_region == "evictable":
                c = evictable_collision(s, ~fixed)
            w = np.full((L, H), 1.0 / r) if cfg.policy == "mean-pool" else head_weights(c, r, cfg.tau)
        if cfg.head_pool != "entropy":      # entrokv-edge: the group's heads pooled by max or by rank
            hd = page_dist(isolated) if cfg.page_score == "sum" else _token_page_max(proj_token_dist(isolated), P)
            pi = group_pool(hd.reshape(L, G, r, inp.n_pages), cfg.head_pool, inp.prot)
            del hd
        elif cfg.page_score == "sum":
            pi = np.einsum("lgrp,lgr->lgp", page_dist(isolated).reshape(L, G, r, inp.n_pages), w.reshape(L, G, r))
        else:
            pi = _token_page_max(pool(proj_token_dist(isolated), w, r), P)
        return pi, w


class Policy:
    """Window scores in, the pages every (layer, KV group) buffer keeps out. ``select`` takes the scores of
    every layer at once, ``select_layers`` one layer at a time (what an eviction does: the arrays a policy
    computes on the way are one layer's)."""

    wants_head_mean = False       # the selection reads the heads' mean page distribution (Inputs.head_mean)
    layer_by_layer = True         # select_layers may select each layer on its own

    def __init__(self, config: EvictionConfig):
        self.config = config

    @property
    def name(self) -> str:
        return self.config.policy

    def protected(self, n: int) -> list[int]:
        """Page indices every group keeps for n tokens (the sinks' and the recent pages)."""
        return self.config.protected(n)

    def replace(self, **changes) -> "Policy":
        """The same policy with other settings (as dataclasses.replace on its config)."""
        return self.with_config(dataclasses.replace(self.config, **changes))

    def with_config(self, config: EvictionConfig) -> "Policy":
        """This policy with ``config`` (the policy it names, where that is another one; wrappers stay)."""
        return type(self)(config) if config.policy == self.config.policy else policy_for(config)

    def check(self, available) -> None:
        """Refuse what this policy cannot select from (ValueError)."""

    def choose(self, inp: Inputs) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(pages [L, G, N'], weights or None, page scores or None)."""
        raise NotImplementedError

    def select(self, s: np.ndarray, r: int, n: int | None = None, *, available: np.ndarray | None = None,
               n_keep: int | None = None, values: np.ndarray | None = None) -> Selection:
        """The pages of window scores s [L, H, n] of a GQA model with group ratio r. available [L, G, n_pages]
        (bool): pages each group buffer still holds (after an earlier eviction); None: all. n_keep: pages to
        keep instead of the budget's N. values [L, G, n]: the norm of each position's value vector per group
        buffer, needed (only) when value_power > 0. An all-zero head counts as uniform over the non-sink
        positions."""
        inp = Inputs(self, s, r, n, available, n_keep, values)
        pages, w, pi = self.choose(inp)
        return Selection(pages=pages, n_budget=inp.N, weights=w, stats=inp.summary, head_pages=inp.head_pages,
                         page_scores=pi)

    def select_layers(self, layer_scores: Callable[[int], np.ndarray], L: int, r: int, n: int, *,
                      available: np.ndarray | None = None, n_keep: int | None = None,
                      values: np.ndarray | None = None) -> Selection:
        """``select`` one layer at a time, the same selection: ``layer_scores(l)`` gives layer l's scores
        [H, n]. Two choices span the layers: head-independent pads every group's union to the longest over
        all layers (its scores are taken all at once), and consensus (> 0) votes over every (layer, group):
        the layers' pooled page scores are kept (small: [L, G, n_pages]), the vote is taken over them, and
        each layer's pages are chosen again with the agreed pages kept, as the joint selection does."""
        if not self.layer_by_layer or L == 0:
            s = np.stack([layer_scores(l) for l in range(L)]) if L else np.zeros((0, 0, n))
            return self.select(s, r, n, available=available, n_keep=n_keep, values=values)
        vote = self.config.consensus > 0
        each = self.replace(consensus=0.0) if vote else self
        parts = [each.select(layer_scores(l)[None], r, n, n_keep=n_keep,
                             available=None if available is None else available[l: l + 1],
                             values=None if values is None else values[l: l + 1]) for l in range(L)]
        cat = lambda xs: np.concatenate(xs, axis=0)      # noqa: E731
        pages = cat([p.pages for p in parts])
        pi = None if parts[0].page_scores is None else cat([p.page_scores for p in parts])
        if vote:
            pages = select_pages(pi, parts[0].n_budget, _with_consensus(self.config, pi, parts[0].n_budget,
                                                                        self.protected(n), available), available)
        w = None if parts[0].weights is None else cat([p.weights for p in parts])
        stats = HeadSummary(*(cat([getattr(p.stats, f.name) for p in parts]) for f in fields(HeadSummary)))
        return Selection(pages=pages, n_budget=parts[0].n_budget, weights=w, stats=stats,
                         head_pages=cat([p.head_pages for p in parts]), page_scores=pi)


def _with_consensus(cfg: EvictionConfig, pi: np.ndarray, N: int, prot: list[int], available) -> list[int]:
    """The protected pages plus the consensus share of every buffer's free pages (the option consensus)."""
    m = math.floor(cfg.consensus * (N - len(prot)) + 1e-9)
    return sorted(set(prot) | set(consensus_pages(pi, m, prot, available)))


class ExactBudget(Policy):
    """A scorer's page scores, and exactly N pages per group buffer: the protected ones and the highest-scoring
    others, ties to the lower page (with consensus > 0, a share of them agreed by every buffer first)."""

    def __init__(self, config: EvictionConfig, scorer: Scorer):
        super().__init__(config)
        self.scorer = scorer

    def with_config(self, config: EvictionConfig) -> Policy:
        return ExactBudget(config, self.scorer) if config.policy == self.config.policy else policy_for(config)

    def choose(self, inp):
        pi, w = self.scorer.score(inp)
        prot = inp.prot
        if inp.cfg.consensus > 0:
            prot = _with_consensus(inp.cfg, pi, inp.N, prot, inp.available)
        pages = select_pages(pi, inp.N, prot, inp.available)
        return pages, w, pi if self.scorer.reported else None


class FullCache(Policy):
    """full: every page (the reference)."""

    def check(self, available) -> None:
        if available is not None and not available.all():
            raise ValueError("the full policy cannot run on a cache that was already evicted")

    def choose(self, inp):
        return np.broadcast_to(np.arange(inp.n_pages, dtype=np.int32), (inp.L, inp.G, inp.n_pages)).copy(), None, None


class HeadIndependent(Policy):
    """head-independent: each query head keeps its own top N pages, so the group buffer must keep their union
    (padded to the largest union: one shared cell index needs equal lengths)."""

    wants_head_mean = True
    layer_by_layer = False

    def choose(self, inp):
        mean = inp.head_mean if inp.available is None else np.where(inp.available, inp.head_mean, -np.inf)
        return union_padded(inp.head_pages, mean), None, None


class Wrapper(Policy):
    """A policy around another: what the wrapper does not change, the inner policy decides."""

    def __init__(self, inner: Policy):
        self.inner = inner

    @property
    def config(self) -> EvictionConfig:
        return self.inner.config

    @property
    def wants_head_mean(self) -> bool:
        return self.inner.wants_head_mean

    @property
    def layer_by_layer(self) -> bool:
        return self.inner.layer_by_layer

    def protected(self, n: int) -> list[int]:
        return self.inner.protected(n)

    def check(self, available) -> None:
        self.inner.check(available)

    def choose(self, inp):
        return self.inner.choose(inp)

    def with_config(self, config: EvictionConfig) -> "Wrapper":
        return self.rewrap(self.inner.with_config(config))

    def rewrap(self, inner: Policy) -> "Wrapper":
        """This wrapper around another inner policy."""
        raise NotImplementedError


class Protect(Wrapper):
    """More pages every group buffer keeps: ``extra(n)`` (page indices for n tokens) beside the inner
    policy's protected pages, at the same budget (an oracle pins facts resident this way; the recall's
    swaps spare them too)."""

    def __init__(self, inner: Policy, extra: Callable[[int], Iterable[int]]):
        super().__init__(inner)
        self.extra = extra

    def protected(self, n: int) -> list[int]:
        n_pages = self.config.n_pages(n)
        return sorted(set(self.inner.protected(n)) | {int(p) for p in self.extra(n) if 0 <= p < n_pages})

    def rewrap(self, inner: Policy) -> "Protect":
        return Protect(inner, self.extra)


class Favour(Wrapper):
    """A bonus on given positions in every selection made layer by layer (what an eviction does):
    ``mask()`` gives bool [L, G, >= n] (the positions each (layer, group) buffer favours, or None: no bonus),
    and each favoured position's score gains ``bonus`` (an oracle steers evictions to a known selection)."""

    def __init__(self, inner: Policy, mask: Callable[[], np.ndarray | None], bonus: float = 1e3):
        super().__init__(inner)
        self.mask, self.bonus = mask, bonus

    def rewrap(self, inner: Policy) -> "Favour":
        return Favour(inner, self.mask, self.bonus)

    def select_layers(self, layer_scores, L, r, n, **kw) -> Selection:
        m = self.mask()
        if m is None:
            return super().select_layers(layer_scores, L, r, n, **kw)

        def scores(l):
            s = np.asarray(layer_scores(l), dtype=np.float64)
            return s + self.bonus * m[l, np.arange(s.shape[0]) // r, : s.shape[-1]]
        return super().select_layers(scores, L, r, n, **kw)


def policy_for(config: EvictionConfig) -> Policy:
    """The policy ``config.policy`` names, with its settings."""
    name = config.policy
    if name == "full":
        return FullCache(config)
    if name == "head-independent":
        return HeadIndependent(config)
    if name == "streaming":
        return ExactBudget(config, Recency())
    if name == "max-pool":
        return ExactBudget(config, GroupMax())
    return ExactBudget(config, EntropyScorer())     # page-entrokv, no-isolation, mean-pool, entrokv-edge


def select(s: np.ndarray, r: int, cfg: EvictionConfig, n: int | None = None, *,
           available: np.ndarray | None = None, n_keep: int | None = None,
           values: np.ndarray | None = None) -> Selection:
    """``policy_for(cfg).select(s, r, n, ...)``: ``cfg.policy`` on window scores s [L, H, n]."""
    return policy_for(cfg).select(s, r, n, available=available, n_keep=n_keep, values=values)


def select_layers(layer_scores: Callable[[int], np.ndarray], L: int, r: int, cfg: EvictionConfig, n: int, *,
                  available: np.ndarray | None = None, n_keep: int | None = None,
                  values: np.ndarray | None = None) -> Selection:
    """``policy_for(cfg).select_layers(...)``: the same selection one layer at a time."""
    return policy_for(cfg).select_layers(layer_scores, L, r, n, available=available, n_keep=n_keep, values=values)


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
