"""entrokv-edge's options (pool, spread, decay, consensus, entropy_region, head_pool, value_power): their definitions against
naive references, the constructed cases they exist for, and the invariants every policy
keeps (exact budget, one set per group, page-entrokv unchanged)."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrokv_edge import EvictionConfig
from entrokv_edge.controller.config import EDGE_DEFAULTS, EDGE_OPTIONS, OFF
from entrokv_edge.controller import select
from entrokv_edge.controller import scoring
from entrokv_edge.controller.policies import EntropyScorer, ExactBudget
from entrokv_edge.controller.scoring import consensus_pages, evictable_collision, group_pool, max_pool, pooled_page_dist
from entrokv_edge.controller.stats import head_page_dist, head_stats

EDGE_OFF = dict(policy="entrokv-edge", **{k: OFF[k] for k in EDGE_OPTIONS})     # every option off


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 80), k=st.sampled_from([0, 1, 3, 5, 7, 9]), seed=st.integers(0, 999))
def test_max_pool_matches_a_naive_window_max(n, k, seed):
    rng = np.random.default_rng(seed)
    s = rng.random((2, 3, n))
    fixed = rng.random(n) < 0.2
    got = max_pool(s, k, fixed)
    want = s.copy()
    if k > 1:
        src = np.where(fixed, 0.0, s)
        for i in range(n):
            if not fixed[i]:
                want[..., i] = src[..., max(0, i - k // 2): i + k // 2 + 1].max(axis=-1)
    assert np.array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(40, 300), P=st.sampled_from([1, 4, 8, 16]), sinks=st.integers(0, 8),
       extra=st.integers(0, 24), seed=st.integers(0, 999))
def test_evictable_entropy_is_taken_over_the_unprotected_pages(n, P, sinks, extra, seed):
    s = np.random.default_rng(seed).random((1, 4, n))
    cfg = EvictionConfig(budget=1.0, page_size=P, window=8, sinks=sinks, recent=8 + extra,
                         **{**EDGE_OFF, "entropy_region": "evictable"})
    prot = set(cfg.protected(n))
    region = [i for i in range(n) if i // P not in prot]
    s[0, 1, region] = 0.0                                   # one head with no mass there: uniform
    want = []
    for h in range(4):
        x = s[0, h, region] if region else s[0, h]
        want.append((x @ x) / x.sum() ** 2 if x.sum() > 0 else 1.0 / len(x))
    got = evictable_collision(s, np.isin(np.arange(n) // P, sorted(prot), invert=True))[0]
    assert got == pytest.approx(want, rel=1e-12)
    # the weights the selection used come from that collision (tau = 1: c / sum over the group)
    c = np.array(want)
    assert np.allclose(select(s, 2, cfg).weights[0], np.concatenate([c[:2] / c[:2].sum(), c[2:] / c[2:].sum()]))


def test_consensus_pages_are_the_mean_vote_over_buffers():
    pi = np.array([[[0.0, 5, 1, 4, 0], [0.0, 0, 1, 4, 5]], [[0.0, 5, 0, 4, 1], [0.0, 1, 0, 4, 5]]])
    # every buffer's scores become one vote; page 3 is second everywhere and first in the mean
    assert consensus_pages(pi, 1, [0]) == [3]
    assert consensus_pages(pi, 2, [0]) == [1, 3]            # 1 and 4 tie on votes: the lower index
    avail = np.ones_like(pi, dtype=bool)
    avail[1, 0, 3] = False                                  # a page one buffer lost cannot be shared
    assert consensus_pages(pi, 1, [0], avail) == [1]
    assert consensus_pages(pi, 9, [0, 4]) == [1, 2, 3]       # no more than the free pages


def _straddle_case():
    """r = 2, pages of 8: a fact in tokens 94..98 straddles pages 11 and 12; the window
    attends to its first tokens (94, 95), not its tail, and a distractor page 5 holds
    slightly more mass than page 12 would get from its own tokens."""
    n, P = 160, 8
    s = np.full((1, 2, n), 0.05 / n)
    s[:, :, 94:96] += 0.30
    s[:, :, 40:48] += 0.02                                  # page 5: diffuse, more than page 12's own
    s /= s.sum(-1, keepdims=True)
    return s, dict(budget=5 * P, page_size=P, window=8, sinks=4)   # pages 0, 19 protected: three free


def test_pooling_keeps_both_pages_of_a_straddling_fact():
    s, kw = _straddle_case()
    plain = select(s, 2, EvictionConfig(**kw, policy="page-entrokv")).pages[0, 0].tolist()
    pooled = select(s, 2, EvictionConfig(**kw, **{**EDGE_OFF, "pool": 7})).pages[0, 0].tolist()
    assert 11 in plain and 12 not in plain and 5 in plain
    assert 11 in pooled and 12 in pooled and len(pooled) == len(plain) == 5


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 90), k=st.sampled_from([0, 1, 3, 7, 15]), spread=st.integers(0, 25),
       decay=st.sampled_from([1.0, 0.9, 0.5]), chunk=st.sampled_from([1 << 18, 1, 100]),
       seed=st.integers(0, 2**16))
def test_max_pool_is_the_window_maximum(n, k, spread, decay, chunk, seed):
    """max_pool against its definition, key by key: the maximum over [i - k//2 - spread,
    i + k//2] of the scores outside the fixed keys, a key j before i - k//2 discounted by
    decay ** (i - k//2 - j); fixed keys keep their own score. Whatever rows it works on
    at once (chunk: one row, a few, all)."""
    rng = np.random.default_rng(seed)
    s = rng.random((2, 3, n))
    fixed = rng.random(n) < 0.2
    out = max_pool(s, k, fixed, spread, decay, chunk=chunk)
    half = k // 2 if k > 1 else 0
    src = np.where(fixed, 0.0, s)
    for i in range(n):
        lo = max(0, i - half - spread)
        disc = decay ** np.maximum(0, i - half - np.arange(lo, min(n, i + half + 1)))
        want = s[..., i] if fixed[i] else (src[..., lo: i + half + 1] * disc).max(axis=-1)
        np.testing.assert_allclose(out[..., i], want, rtol=1e-12, atol=0)
        if decay == 1.0:
            assert np.array_equal(out[..., i], want)


def _whole_pooled_page_dist(s, cfg, fixed, isolated=True):
    """The pooled scores' page distributions the plain way: all of s pooled, then head_stats."""
    return head_page_dist(head_stats(max_pool(s, cfg.pool, fixed, cfg.spread, cfg.decay), cfg.sinks, cfg.page_size),
                          isolated)


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 4), n=st.integers(1, 200), P=st.sampled_from([1, 4, 16]), pool=st.sampled_from([0, 3, 7]),
       spread=st.integers(0, 30), decay=st.sampled_from([1.0, 0.85]), sinks=st.integers(0, 6),
       f32=st.booleans(), isolated=st.booleans(), seed=st.integers(0, 999))
def test_pooled_page_dist_layer_by_layer_equals_that_of_the_pooled_scores(L, n, P, pool, spread, decay, sinks, f32,
                                                                          isolated, seed):
    """select's memory-lean path (one layer pooled at a time) gives what pooling all of s,
    then taking its page distributions, gives (to the last bits a BLAS sum over fewer rows may change)."""
    rng = np.random.default_rng(seed)
    s = rng.random((L, 6, n)) ** 4
    s = s.astype(np.float32) if f32 else s
    fixed = rng.random(n) < 0.1
    cfg = EvictionConfig(policy="entrokv-edge", page_size=P, window=1, recent=1, sinks=sinks, pool=pool,
                         spread=spread, decay=decay)
    got, want = pooled_page_dist(s, cfg, fixed, isolated), _whole_pooled_page_dist(s, cfg, fixed, isolated)
    assert got.shape == want.shape == (L, 6, -(-n // P))
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-300)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(200, 600), P=st.sampled_from([1, 4, 16]), head_pool=st.sampled_from(["entropy", "max", "rank"]),
       region=st.sampled_from(["sinks", "evictable"]), consensus=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 2**16))
def test_select_keeps_the_same_pages_as_with_the_whole_pooled_copy(n, P, head_pool, region, consensus, seed):
    """entrokv-edge's selection (page sums) is the one the whole pooled copy of s gives."""
    s = np.random.default_rng(seed).random((3, 6, n)) ** 8
    cfg = EvictionConfig(budget=0.3, page_size=P, window=16, policy="entrokv-edge", head_pool=head_pool,
                         entropy_region=region, consensus=consensus)
    got = select(s, 3, cfg).pages

    class Whole(EntropyScorer):         # the scorer with the whole pooled copy
        def pooled_dist(self, s, cfg, fixed, isolated):
            return _whole_pooled_page_dist(s, cfg, fixed, isolated)
    want = ExactBudget(cfg, Whole()).select(s, 3).pages
    assert np.array_equal(got, want)


def test_spread_keeps_the_pages_after_an_attended_key():
    """A key attended at the end of page 11 (P = 8) whose fact fills pages 12-13 (a value after
    the words that point at it): pool 7 alone reaches page 12 only; spread 12 reaches 13 too,
    and never the page before the key's own."""
    n, P = 200, 8
    s = np.full((1, 2, n), 0.05 / n)
    s[:, :, 94:96] += 0.30
    s[:, :, 40:48] += 0.02                                  # two diffuse pages with more mass than
    s[:, :, 160:168] += 0.02                                # the fact's own tail pages
    s /= s.sum(-1, keepdims=True)
    kw = dict(budget=6 * P, page_size=P, window=8, sinks=4, **{**EDGE_OFF, "head_pool": "rank", "pool": 7})
    pooled = select(s, 2, EvictionConfig(**kw)).pages[0, 0].tolist()
    spread = select(s, 2, EvictionConfig(**{**kw, "spread": 12})).pages[0, 0].tolist()
    assert {11, 12} <= set(pooled) and 13 not in pooled
    assert {11, 12, 13} <= set(spread) and 10 not in spread and len(spread) == len(pooled) == 6


def test_decay_discounts_the_far_followers():
    """decay: a strong key ends page 11 (P = 8), a weak one (0.08 vs 0.30) sits in page 20;
    spread 16. Flat, every follower counts in full, so page 21 (eight followers of the weak
    key: 8 x 0.08) outranks page 11 (the strong key alone) and the strong key's own page is
    lost. With decay 0.8 a follower d keys on counts at 0.8 ** d: page 21 falls to < 0.2
    and page 11 comes back; the strong key's near followers (12, 13) stay."""
    n, P = 200, 8
    s = np.full((1, 2, n), 0.01 / n)
    s[:, :, 95] += 0.30
    s[:, :, 163] += 0.08
    s /= s.sum(-1, keepdims=True)
    kw = dict(budget=6 * P, page_size=P, window=8, sinks=4, **{**EDGE_OFF, "head_pool": "rank", "spread": 16})
    flat = select(s, 2, EvictionConfig(**kw)).pages[0, 0].tolist()
    decayed = select(s, 2, EvictionConfig(**{**kw, "decay": 0.8})).pages[0, 0].tolist()
    assert flat == [0, 12, 13, 20, 21, 24]
    assert decayed == [0, 11, 12, 13, 20, 24]


def test_pooling_does_not_spread_the_sinks():
    n = 64
    s = np.full((1, 2, n), 0.01)
    s[:, :, 0] = 50.0                                        # a sink that would flood its neighbours
    fixed = np.arange(n) < 4
    pooled = max_pool(s, 7, fixed)
    assert (pooled[..., 4:] <= 0.01 + 1e-15).all() and pooled[0, 0, 0] == 50.0
    s[:, :, n - 8:] = 30.0                                   # nor does the recent window (protected)
    cfg = EvictionConfig(budget=6 * 8, page_size=8, window=8, sinks=4, policy="entrokv-edge", pool=7,
                         consensus=0.0, entropy_region="sinks", head_pool="entropy")
    plain = select(s, 2, EvictionConfig(budget=6 * 8, page_size=8, window=8, sinks=4, policy="page-entrokv"))
    assert np.array_equal(select(s, 2, cfg).pages, plain.pages)   # flat elsewhere: pooling changes nothing


def test_consensus_keeps_a_page_every_buffer_ranks_third():
    L, G, r, n, P = 3, 2, 2, 128, 8
    rng = np.random.default_rng(0)
    s = rng.random((L, G * r, n)) * 0.01
    for l in range(L):
        for g in range(G):
            b = l * G + g                                       # each buffer's two own favourites
            for own, extra in ((1 + b, 0.08), (7 + b, 0.07)):
                s[l, g * r:(g + 1) * r, own * P:(own + 1) * P] += extra
    s[:, :, 14 * P:15 * P] += 0.05                              # page 14: everybody's third choice
    kw = dict(budget=4 * P, page_size=P, window=8, sinks=4)     # pages 0 and 15 protected, 2 free
    base = select(s, r, EvictionConfig(**kw, **EDGE_OFF)).pages
    cons = select(s, r, EvictionConfig(**kw, **{**EDGE_OFF, "consensus": 0.5})).pages
    assert not (base == 14).any()
    assert (cons == 14).all(axis=(0, 1)).any() and cons.shape == base.shape == (L, G, 4)
    for l in range(L):                                          # the other free page: the buffer's favourite
        for g in range(G):
            assert cons[l, g].tolist() == sorted([0, 1 + l * G + g, 14, 15])


def test_evictable_entropy_weights_the_retrieval_head_over_a_recent_focused_one():
    """Head 0 attends sharply to the recent window (always kept anyway); head 1 to one old
    token. Over the sinks-isolated keys head 0 looks the most concentrated; over the
    evictable keys head 1 does, and its page is then kept."""
    n, P = 256, 16
    s = np.full((1, 2, n), 1e-4)
    s[0, 0, n - 2:] += 2.0                                    # head 0: the last 2 tokens
    s[0, 0, 64:80] += 0.05                                    # ... and a diffuse old page (4)
    s[0, 1, 170] += 0.3                                       # head 1: the needle (page 10)
    s[0, 1, n - 16:] += 0.04
    s /= s.sum(-1, keepdims=True)
    kw = dict(budget=3 * P, page_size=P, window=16, sinks=4)   # pages 0 and 15 protected: one free
    method = select(s, 2, EvictionConfig(**kw, policy="page-entrokv"))
    edge = select(s, 2, EvictionConfig(**kw, **{**EDGE_OFF, "entropy_region": "evictable"}))
    assert method.weights[0, 0] > method.weights[0, 1] and 4 in method.pages[0, 0]
    assert edge.weights[0, 1] > edge.weights[0, 0] and 10 in edge.pages[0, 0]


@settings(max_examples=40, deadline=None)
@given(r=st.sampled_from([1, 2, 3, 4]), P=st.sampled_from([1, 4, 8, 16]), n=st.integers(64, 600),
       mode=st.sampled_from(["sum", "max"]), seed=st.integers(0, 2**16))
def test_edge_with_every_option_off_is_page_entrokv(r, P, n, mode, seed):
    s = np.random.default_rng(seed).dirichlet(np.full(n, 0.3), size=(2, 2 * r))
    kw = dict(budget=max(int(0.3 * n), (2 + -(-4 // P) + -(-32 // P)) * P), page_size=P, window=32, page_score=mode)
    a = select(s, r, EvictionConfig(**kw, policy="page-entrokv")).pages
    b = select(s, r, EvictionConfig(**kw, **EDGE_OFF)).pages
    assert np.array_equal(a, b)


@settings(max_examples=40, deadline=None)
@given(G=st.integers(1, 3), r=st.integers(1, 4), n_pages=st.integers(3, 30), seed=st.integers(0, 999))
def test_group_pool_max_and_rank_match_their_definitions(G, r, n_pages, seed):
    rng = np.random.default_rng(seed)
    hd = rng.random((2, G, r, n_pages))
    hd[0, 0, 0, 1] = hd[0, 0, 0, 2]                         # a tie inside one head
    prot = [0, n_pages - 1]
    assert np.array_equal(group_pool(hd, "max", prot), hd.max(axis=2))
    got = group_pool(hd, "rank", prot)
    for li in range(2):
        for g in range(G):
            best = {}
            for h in range(r):                               # each head's own order, ties to the lower page
                free = [j for j in range(n_pages) if j not in prot]
                order = sorted(free, key=lambda j: (-hd[li, g, h, j], j)) + prot
                for k, j in enumerate(order):
                    best[j] = min(best.get(j, k), k)
            ranking = sorted(range(n_pages), key=lambda j: (best[j], -hd[li, g, :, j].max(), j))
            mine = sorted(range(n_pages), key=lambda j: (-got[li, g, j], j))
            assert [j for j in mine if j not in prot] == [j for j in ranking if j not in prot]


def test_rank_pooling_gives_every_head_its_first_choice():
    """r = 3 heads, 3 free pages: head 0 wants pages 2 and 3 loudly, heads 1 and 2 one
    token each (pages 5, 7) over a diffuse background. Mean, max and entropy pooling keep
    both of head 0's pages; rank pooling keeps every head's first choice."""
    n, P = 160, 16                                          # 10 pages; 0 and 9 protected
    s = np.full((1, 3, n), 1e-3)
    s[0, 0, 2 * P:3 * P] += 0.05
    s[0, 0, 3 * P:4 * P] += 0.045
    s[0, 1:, :] += 0.004
    s[0, 1, 5 * P + 3] += 0.2
    s[0, 2, 7 * P + 9] += 0.15
    s /= s.sum(-1, keepdims=True)
    kw = dict(budget=5 * P, page_size=P, window=16, sinks=4)
    rank = select(s, 3, EvictionConfig(**kw, **{**EDGE_OFF, "head_pool": "rank"})).pages[0, 0].tolist()
    assert rank == [0, 2, 5, 7, 9]
    for other in (dict(EDGE_OFF, head_pool="max"), dict(policy="mean-pool"), dict(policy="page-entrokv")):
        assert select(s, 3, EvictionConfig(**kw, **other)).pages[0, 0].tolist() == [0, 2, 3, 5, 9]


@settings(max_examples=60, deadline=None)
@given(P=st.sampled_from([1, 4, 8, 16]), n=st.integers(80, 700), pool=st.sampled_from([0, 3, 7, 11]),
       consensus=st.sampled_from([0.0, 0.25, 0.5, 0.9]), region=st.sampled_from(["sinks", "evictable"]),
       frac=st.floats(0.15, 0.9), seed=st.integers(0, 2**16))
def test_edge_keeps_the_exact_budget_and_one_set_per_group(P, n, pool, consensus, region, frac, seed):
    s = np.random.default_rng(seed).random((3, 6, n))
    budget = max(int(frac * n), (2 + -(-4 // P) + -(-16 // P)) * P)
    cfg = EvictionConfig(budget=budget, page_size=P, window=16, policy="entrokv-edge", pool=pool, spread=seed % 25,
                         decay=[1.0, 0.8][seed % 2], page_score=["sum", "max"][(seed // 3) % 2],
                         consensus=consensus, entropy_region=region, head_pool=["entropy", "max", "rank"][seed % 3],
                         value_power=[0.0, 2.0][(seed // 2) % 2])
    values = np.random.default_rng(seed + 1).random((3, 2, n)) * 4        # some keys' values near 0
    sel = select(s, 3, cfg, values=values)
    N = cfg.budget_pages(n)
    assert sel.pages.shape == (3, 2, N) and (np.diff(sel.pages, axis=-1) > 0).all()
    assert set(cfg.protected(n)) <= set(sel.pages[1, 1].tolist())
    if consensus:        # the shared pages sit in every buffer
        m = int(consensus * (N - len(cfg.protected(n))))
        common = set.intersection(*(set(x.tolist()) for x in sel.pages.reshape(-1, N)))
        assert len(common) >= len(cfg.protected(n)) + m


def test_edge_options_are_validated_and_resolved():
    assert EvictionConfig().policy == "entrokv-edge"                     # the default since the held-out split
    assert EvictionConfig(policy="page-entrokv").pool == 0 and EvictionConfig(policy="mean-pool").head_pool == "entropy"
    e = EvictionConfig(policy="entrokv-edge")
    assert {k: getattr(e, k) for k in EDGE_DEFAULTS} == EDGE_DEFAULTS
    assert EvictionConfig(policy="entrokv-edge", pool=3).pool == 3
    assert EvictionConfig(**dataclasses.asdict(e)) == e                 # a saved session loads back
    with pytest.raises(ValueError, match="belong to the entrokv-edge policy"):
        EvictionConfig(policy="page-entrokv", pool=7)
    with pytest.raises(ValueError, match="belong to the entrokv-edge policy"):
        EvictionConfig(policy="mean-pool", consensus=0.5)
    with pytest.raises(ValueError, match="odd"):
        EvictionConfig(policy="entrokv-edge", pool=4)
    with pytest.raises(ValueError, match="consensus"):
        EvictionConfig(policy="entrokv-edge", consensus=1.0)
    with pytest.raises(ValueError, match="entropy_region"):
        EvictionConfig(policy="entrokv-edge", entropy_region="recent")
    with pytest.raises(ValueError, match="pool"):
        EvictionConfig(policy="entrokv-edge", pool=-1)
    with pytest.raises(ValueError, match="head_pool"):
        EvictionConfig(policy="entrokv-edge", head_pool="mean")
    with pytest.raises(ValueError, match="spread"):
        EvictionConfig(policy="entrokv-edge", spread=-1)
    with pytest.raises(ValueError, match="spread"):
        EvictionConfig(policy="entrokv-edge", spread=True)
    with pytest.raises(ValueError, match="belong to the entrokv-edge policy"):
        EvictionConfig(policy="max-pool", spread=20)
    assert EvictionConfig(policy="page-entrokv").spread == 0 and EvictionConfig(policy="entrokv-edge", spread=0).spread == 0
    for bad in (0.0, 1.5, -0.2, True, "0.8", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="decay must be a number in"):
            EvictionConfig(policy="entrokv-edge", decay=bad)
    with pytest.raises(ValueError, match="belong to the entrokv-edge policy"):
        EvictionConfig(policy="page-entrokv", decay=0.8)
    assert EvictionConfig(policy="entrokv-edge", decay=0.8).decay == 0.8 and EvictionConfig(policy="mean-pool").decay == 1.0
    with pytest.raises(ValueError, match="belong to the entrokv-edge policy"):
        EvictionConfig(policy="page-entrokv", head_pool="rank")
    # (option, bad values, the error, a good value, another policy that must refuse it)
    for name, bads, msg, good, other in (
            ("value_power", (-0.5, 4.5, True, "2", float("nan"), float("inf"), [2]), "value_power must be a number in",
             2, "head-independent"),
            ("lookahead", (-1, 65, True, 4.0, "8", 2.5), r"lookahead must be an integer in \[0, 64\]", 64, "page-entrokv"),
            ("lookahead_share", (-0.1, 1.01, True, "0.5", float("nan"), float("inf")),
             r"lookahead_share must be a number in \[0, 1\]", 1, "mean-pool"),
            ("guide_consensus", (-0.1, 1.0, True, "0.25", float("nan"), float("inf")),
             r"guide_consensus must be a share in \[0, 1\)", 0.5, "page-entrokv")):
        for bad in bads:
            with pytest.raises(ValueError, match=msg):
                EvictionConfig(policy="entrokv-edge", **{name: bad})
        with pytest.raises(ValueError, match="belong to the entrokv-edge policy"):
            EvictionConfig(policy=other, **{name: good})
        assert getattr(EvictionConfig(policy="entrokv-edge", **{name: good}), name) == good
        assert getattr(EvictionConfig(policy="max-pool"), name) == OFF[name] == 0


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 3), G=st.integers(1, 3), r=st.integers(1, 4), n=st.integers(1, 50),
       power=st.sampled_from([0.5, 1.0, 2.0, 3.0]), f32=st.booleans(), seed=st.integers(0, 999))
def test_value_weighted_scales_each_head_by_its_groups_norms(L, G, r, n, power, f32, seed):
    rng = np.random.default_rng(seed)
    s = rng.random((L, G * r, n)).astype(np.float32 if f32 else np.float64)
    v = rng.random((L, G, n)) * 3
    keep = s.copy()
    got = scoring.value_weighted(s, v, r, power)
    want = np.empty((L, G * r, n))
    for l in range(L):
        for h in range(G * r):
            for t in range(n):
                want[l, h, t] = float(s[l, h, t]) * float(v[l, h // r, t]) ** power
    assert got.dtype == s.dtype and np.array_equal(s, keep)
    np.testing.assert_allclose(got, want, rtol=1e-5 if f32 else 1e-12)


def test_value_power_keeps_the_page_whose_values_matter():
    """Two pages draw the same attention; the one whose values are larger holds more of the
    head's output. With value_power the budget's one free page goes to it; without, the tie
    goes to the lower page."""
    n, P = 64, 8
    s = np.full((1, 2, n), 1e-3)
    s[:, :, 20:24] = s[:, :, 36:40] = 0.2
    v = np.ones((1, 1, n))
    v[..., 36:40] = 4.0
    kw = dict(EDGE_OFF, budget=24, page_size=P, sinks=4, window=8)
    assert select(s, 2, EvictionConfig(**kw)).pages[0, 0].tolist() == [0, 2, 7]
    assert select(s, 2, EvictionConfig(**{**kw, "value_power": 1.0}), values=v).pages[0, 0].tolist() == [0, 4, 7]
    with pytest.raises(ValueError, match="needs the value norms"):
        select(s, 2, EvictionConfig(**{**kw, "value_power": 1.0}))
    for bad in (np.ones((1, 2, n)), -v, v * np.nan):
        with pytest.raises(ValueError, match="values must be"):
            select(s, 2, EvictionConfig(**{**kw, "value_power": 1.0}), values=bad)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(120, 500), P=st.sampled_from([4, 8, 16]), consensus=st.sampled_from([0.25, 0.5, 0.9]),
       pool=st.sampled_from([0, 7]), seed=st.integers(0, 2**16))
def test_edge_re_evicts_a_cache_whose_buffers_hold_different_pages(n, P, consensus, pool, seed):
    """A second eviction: every buffer chooses among the pages it still holds, consensus
    pages only among those every buffer holds, and each still keeps exactly N."""
    rng = np.random.default_rng(seed)
    s = rng.random((2, 6, n))
    cfg = EvictionConfig(budget=0.3, page_size=P, window=16, policy="entrokv-edge", pool=pool, consensus=consensus)
    N, prot, n_pages = cfg.budget_pages(n), cfg.protected(n), cfg.n_pages(n)
    avail = rng.random((2, 2, n_pages)) < 0.6
    avail[..., prot] = True
    for row in avail.reshape(-1, n_pages):            # every buffer holds at least N pages
        missing = np.flatnonzero(~row)
        row[missing[: max(0, N - int(row.sum()))]] = True
    sel = select(s, 3, cfg, available=avail)
    assert sel.pages.shape == (2, 2, N)
    li, gi, _ = np.indices(sel.pages.shape)
    assert avail[li, gi, sel.pages].all()             # nothing it no longer holds
    m = int(consensus * (N - len(prot)) + 1e-9)
    common = set.intersection(*(set(x.tolist()) for x in sel.pages.reshape(-1, N)))
    held_by_all = int(avail.reshape(-1, n_pages).all(axis=0).sum()) - len(prot)
    assert len(common) >= len(prot) + min(m, held_by_all)
