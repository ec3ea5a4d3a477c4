"""The controller's definitions: metrics identities, exact budgets, tie-breaking, the
constructed cases of the method, and agreement between the Python and C selectors."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrokv_edge import POLICIES, EvictionConfig
from entrokv_edge.bindings import select_pages_native
from entrokv_edge.controller import metrics as M
from entrokv_edge.controller import select
from entrokv_edge.controller.pages import page_scores, pages_to_positions, select_pages
from entrokv_edge.controller.stats import head_page_dist, head_stats
from entrokv_edge.controller.weights import collision, head_weights, isolate_sinks, masquerade_ratio


@st.composite
def head_sets(draw, r):
    n_pages = draw(st.integers(4, 40))
    N = draw(st.integers(1, n_pages))
    sets = [np.sort(np.array(draw(st.permutations(range(n_pages)))[:N])) for _ in range(r)]
    return np.stack(sets)[None].astype(np.int32), N, n_pages  # [1, r, N]


@given(head_sets(2))
def test_uor_equals_one_plus_disagreement_for_pairs(data):
    hp, N, n_pages = data
    assert np.isclose(M.uor(hp, 2, n_pages)[0, 0], 1 + M.disagreement(hp, 2, n_pages)[0, 0])


@given(st.integers(2, 6).flatmap(lambda r: head_sets(r).map(lambda d: (r, d))))
def test_uor_bounds_for_every_group_ratio(arg):
    r, (hp, N, n_pages) = arg
    u = M.uor(hp, r, n_pages)[0, 0]
    d = M.disagreement(hp, r, n_pages)[0, 0]
    assert 1 + d - 1e-12 <= u <= 1 + (r - 1) * d + 1e-12


@settings(max_examples=150, deadline=None)
@given(P=st.integers(1, 64), n=st.integers(1, 700), sinks=st.integers(0, 40), extra=st.integers(0, 60),
       frac=st.floats(0.05, 1.0), policy=st.sampled_from(POLICIES), seed=st.integers(0, 2**16))
def test_budget_is_exact_for_every_page_size(P, n, sinks, extra, frac, policy, seed):
    window = max(1, min(n, 8))
    cfg_args = dict(page_size=P, window=window, sinks=sinks, recent=window + extra, policy=policy)
    budget = max(1, int(frac * n))
    if policy != "full" and budget // P < -(-sinks // P) + -(-(window + extra) // P):
        with pytest.raises(ValueError, match="protected pages"):
            EvictionConfig(budget=budget, **cfg_args)
        cfg_args["policy"] = policy = "full"
    cfg = EvictionConfig(budget=budget, **cfg_args)
    s = np.random.default_rng(seed).random((2, 6, n))
    need = len(cfg.protected(n))
    N_exp = cfg.n_pages(n) if (policy == "full" or budget >= n) else min(budget // P, cfg.n_pages(n))
    if policy != "full" and N_exp < need:
        with pytest.raises(ValueError, match="protected pages"):
            select(s, 3, cfg)
        return
    sel = select(s, 3, cfg)
    pos = pages_to_positions(sel.pages, P, n)
    N = N_exp
    assert sel.n_budget == N
    if policy != "head-independent":
        assert sel.pages.shape == (2, 2, N)             # exactly N pages in every (layer, group)
    assert (np.diff(sel.pages, axis=-1) > 0).all()
    assert set(cfg.protected(n)) <= set(sel.pages[0, 0].tolist())
    assert pos.shape[:2] == (2, 2) and (pos < n).all()   # the same token count everywhere


@given(P=st.integers(1, 16), n=st.integers(40, 300), seed=st.integers(0, 1000))
def test_ties_break_to_lower_positions_deterministically(P, n, seed):
    cfg = EvictionConfig(budget=max(n // 2, 40), page_size=P, window=8, sinks=2, policy="page-entrokv")
    s = np.ones((1, 4, n)) / n
    a, b = select(s, 2, cfg), select(s.copy(), 2, cfg)
    assert np.array_equal(a.pages, b.pages)
    prot = cfg.protected(n)
    free = [j for j in range(cfg.n_pages(n)) if j not in prot][: a.n_budget - len(prot)]
    assert a.pages[0, 0].tolist() == sorted(prot + free)


@pytest.mark.parametrize("P", range(1, 65))
def test_page_entrokv_keeps_one_set_per_group_for_every_page_size(P):
    n = 1000 + P // 2 + 1                                 # never a multiple of P (but for P = 1)
    cfg = EvictionConfig(budget=0.3, page_size=P, window=32, sinks=4 + P // 3, policy="page-entrokv")   # protections may overlap
    sel = select(np.random.default_rng(P).random((3, 9, n)), 3, cfg)
    N = min(int(0.3 * n) // P, -(-n // P))
    assert sel.n_budget == N and sel.pages.shape == (3, 3, N)   # UOR = 1.000 exactly, everywhere
    pos = pages_to_positions(sel.pages, P, n)
    assert pos.shape == (3, 3, (N - 1) * P + (n - (n // P) * P or P))
    u = M.uor(sel.head_pages, 3)
    assert u.min() >= 1.0 and u.max() <= 3.0


def _needle_case():
    """One group of r = 3 heads over 16 pages of 16 tokens: two diffuse heads that
    favour page 3, one retrieval head locked on a needle token in page 10."""
    n, P = 256, 16
    s = np.full((1, 3, n), 0.2 / n)
    s[0, 0:2, 48:64] += 0.5 / 16          # heads 0, 1: half their mass spread over page 3
    s[0, 2, 165] += 0.9                    # head 2: the needle (page 10)
    s /= s.sum(-1, keepdims=True)
    return s, EvictionConfig(budget=3 * P, page_size=P, window=16, sinks=4, policy="page-entrokv")  # pages 0 and 15 protected: one free pick


def test_constructed_needle_survives_page_entrokv_but_not_mean_pooling():
    s, cfg = _needle_case()
    ours = select(s, 3, cfg).pages[0, 0].tolist()
    mean = select(s, 3, EvictionConfig(**{**cfg.__dict__, "policy": "mean-pool"})).pages[0, 0].tolist()
    assert 10 in ours and 10 not in mean and 3 in mean


def test_constructed_sink_head_loses_its_weight_under_isolation():
    n = 200
    rng = np.random.default_rng(0)
    s = rng.random((1, 3, n)) * 0.01
    s[0, 0, 0] = 5.0                        # head 0 dumps its attention on the sink
    s[0, 1, 120:124] += 0.2                 # head 1 is the real retrieval head
    s /= s.sum(-1, keepdims=True)
    w_iso = head_weights(collision(isolate_sinks(s, 4)[0]), 3)
    ratio = masquerade_ratio(s, 4, 3)
    assert ratio[0, 0] > 5 and w_iso[0, 0] < w_iso[0, 1]
    nis = select(s, 3, EvictionConfig(budget=8 * 4, page_size=4, window=8, policy="no-isolation"))
    ent = select(s, 3, EvictionConfig(budget=8 * 4, page_size=4, window=8, policy="page-entrokv"))
    assert 30 in ent.pages[0, 0] and ent.weights[0, 1] > 0.5 > nis.weights[0, 1]


def test_all_sink_heads_fall_back_to_uniform():
    s = np.zeros((1, 2, 50))
    s[0, :, :4] = 0.25
    p, flagged = isolate_sinks(s, 4)
    assert flagged.all() and np.allclose(p[0, 0, 4:], 1 / 46) and (p[..., :4] == 0).all()


@pytest.mark.parametrize("P", [1, 4, 8])
def test_page_distributions_are_the_page_sums_of_the_isolated_ones(P):
    """head_page_dist (from page statistics) against isolate_sinks' token distributions summed
    per page, an all-sink head (the uniform fallback) among normal ones."""
    s = np.random.default_rng(P).random((2, 3, 50))
    s[1, 2, 4:] = 0.0
    p, flagged = isolate_sinks(s, 4)
    assert flagged.sum() == 1 and flagged[1, 2]
    want = np.add.reduceat(p, np.arange(0, 50, P), axis=-1)
    np.testing.assert_allclose(head_page_dist(head_stats(s, 4, P)), want, rtol=1e-12, atol=1e-15)


@settings(max_examples=40, deadline=None)
@given(r=st.sampled_from([1, 2, 3, 4, 6]), P=st.integers(1, 32), n=st.integers(64, 900),
       tau=st.sampled_from([0.5, 1.0, 2.0]), mode=st.sampled_from(["sum", "max"]), seed=st.integers(0, 2**16))
def test_python_and_c_selectors_agree(r, P, n, tau, mode, seed):
    H = 6 if r in (1, 2, 3, 6) else 8
    G = H // r
    rng = np.random.default_rng(seed)
    s = rng.dirichlet(np.full(n, 0.3), size=(3, H)).astype(np.float32)
    window = min(32, n)
    budget = max(int(0.3 * n), (2 + -(-4 // P) + -(-window // P)) * P)
    cfg = EvictionConfig(budget=budget, page_size=P, window=window, tau=tau, page_score=mode, policy="page-entrokv")
    py = select(s.astype(np.float64), r, cfg).pages
    c = select_pages_native(s, G, budget=budget, page_size=P, sinks=cfg.sinks, recent=cfg.rho, tau=tau,
                            page_max=(mode == "max"))
    assert np.array_equal(py, c)


def test_config_validation_messages():
    with pytest.raises(ValueError, match="page_size"):
        EvictionConfig(page_size=0)
    with pytest.raises(ValueError, match="unknown policy"):
        EvictionConfig(policy="best")
    with pytest.raises(ValueError, match="recent"):
        EvictionConfig(window=32, recent=8)
    with pytest.raises(ValueError, match="fraction"):
        EvictionConfig(budget=1.5)
    with pytest.raises(ValueError, match="longer than the prompt"):
        EvictionConfig(window=64).budget_pages(40)
    with pytest.raises(ValueError, match="protected pages"):
        EvictionConfig(budget=16, page_size=16)              # a token budget is checked at once
    with pytest.raises(ValueError, match="protected pages"):
        EvictionConfig(budget=0.01, page_size=16).budget_pages(1000)   # a fraction once n is known


def test_page_scores_sum_and_max_on_partial_last_page():
    S = np.arange(10, dtype=float)[None]
    assert page_scores(S, 4).tolist() == [[6, 22, 17]]
    assert page_scores(S, 4, "max").tolist() == [[3, 7, 9]]
    assert select_pages(np.array([[1.0, 5.0, 5.0, 0.0]]), 2, [0]).tolist() == [[0, 1]]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 12), n_pages=st.integers(1, 40), chunk=st.sampled_from([1, 7, 64, 1 << 18]),
       masked=st.booleans(), data=st.data())
def test_select_pages_matches_a_sort_and_does_not_depend_on_its_row_chunks(rows, n_pages, chunk, masked, data):
    """Per row: the protected pages, then the rest by (score descending, page ascending), the
    first N, sorted; with ``available`` only the pages a row holds. Many ties (scores 0-3)."""
    import entrokv_edge.controller.pages as pages_mod
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    pi = rng.integers(0, 4, size=(rows, n_pages)).astype(float)
    prot = sorted(set(rng.integers(0, n_pages, size=rng.integers(0, 3)).tolist()))
    N = data.draw(st.integers(len(prot), n_pages))
    avail = None
    if masked:
        avail = rng.random((rows, n_pages)) < 0.8
        avail[:, prot] = True
        short = avail.sum(axis=-1) < N
        avail[short] = True                      # every row can still keep N
    saved, pages_mod._ROWS_CHUNK = pages_mod._ROWS_CHUNK, chunk
    try:
        got = select_pages(pi, N, prot, avail)
    finally:
        pages_mod._ROWS_CHUNK = saved
    assert got.shape == (rows, N) and got.dtype == np.int32
    for i in range(rows):
        free = [j for j in range(n_pages) if j not in prot and (avail is None or avail[i, j])]
        free.sort(key=lambda j: (-pi[i, j], j))
        assert got[i].tolist() == sorted(prot + free[: N - len(prot)])


def test_select_pages_ranks_nan_scores_last():
    pi = np.array([[np.nan, 1.0, np.nan, 3.0, 2.0]])
    assert select_pages(pi, 3, []).tolist() == [[1, 3, 4]]
    assert select_pages(pi, 4, [2]).tolist() == [[1, 2, 3, 4]]
    assert select_pages(pi, 5, []).tolist() == [[0, 1, 2, 3, 4]]
    held = np.array([[False, True, True, True, True]])                  # a NaN page held beats one the row lacks
    assert select_pages(np.array([[5.0, 1.0, np.nan, 2.0, 3.0]]), 4, [], held).tolist() == [[1, 2, 3, 4]]


def test_full_policy_refuses_an_evicted_cache_with_its_own_message():
    cfg = EvictionConfig(budget=1.0, page_size=4, window=8, policy="full")
    avail = np.ones((1, 2, 25), dtype=bool)
    avail[0, 1, 10] = False
    with pytest.raises(ValueError, match="full policy cannot run on a cache that was already evicted"):
        select(np.random.default_rng(0).random((1, 4, 100)), 2, cfg, available=avail)
    assert select(np.ones((1, 4, 100)), 2, cfg).pages.shape == (1, 2, 25)


def test_head_pages_are_each_head_alone_whatever_the_policy_protects():
    """The UOR replay (Selection.head_pages) is each head's own top-N with the sinks and the
    recent pages protected, not the consensus pages a policy protects on top."""
    rng = np.random.default_rng(5)
    s = rng.random((2, 6, 300)) ** 6
    base = dict(budget=0.2, page_size=4, window=16, policy="entrokv-edge")
    plain = select(s, 3, EvictionConfig(**base, consensus=0.0))
    cons = select(s, 3, EvictionConfig(**base, consensus=0.5))
    assert not np.array_equal(plain.pages, cons.pages)
    np.testing.assert_array_equal(cons.head_pages, plain.head_pages)
    cfg = EvictionConfig(**base)
    st_ = head_stats(s, cfg.sinks, cfg.page_size)
    np.testing.assert_array_equal(plain.head_pages, select_pages(head_page_dist(st_), plain.n_budget, cfg.protected(300)))


@given(P=st.integers(1, 16), n=st.integers(1, 200), sinks=st.integers(0, 8), seed=st.integers(0, 999))
def test_head_stats_without_page_all_equal_those_with_it(P, n, sinks, seed):
    s = np.random.default_rng(seed).random((2, 3, n)) ** 4
    full, lean = head_stats(s, sinks, P), head_stats(s, sinks, P, keep_all=False)
    assert lean.page_all is None and full.page_all.shape == full.page_iso.shape
    for f in ("page_iso", "mass_iso", "mass_all", "c_iso", "c_all", "flagged", "uniform_pages"):
        assert np.array_equal(getattr(full, f), getattr(lean, f)), f


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1e-6])
def test_both_selectors_refuse_scores_that_are_not_attention_weights(bad):
    """A NaN, an infinity or a negative score: the C selector refuses it (INVALID_ARG, naming
    where), the Python one raises ValueError; -0.0 and zeros are attention weights."""
    from entrokv_edge import EntroKVError
    s = np.random.default_rng(0).dirichlet(np.full(64, 0.5), size=(2, 6)).astype(np.float32)
    cfg = EvictionConfig(budget=32, page_size=4, window=8, policy="page-entrokv")
    ok = s.copy()
    ok[0, 1, 5], ok[1, 2] = -0.0, 0.0
    assert np.array_equal(select_pages_native(ok, 2, budget=32, page_size=4, sinks=4, recent=8),
                          select(ok.astype(np.float64), 3, cfg).pages)
    s[1, 4, 17] = bad
    with pytest.raises(EntroKVError, match=r"INVALID_ARG.*scores\[1\]\[4\]\[17\]"):
        select_pages_native(s, 2, budget=32, page_size=4, sinks=4, recent=8)
    with pytest.raises(ValueError, match="finite and >= 0"):
        select(s.astype(np.float64), 3, cfg)


@pytest.mark.parametrize("budget", [50, 51, 400])
def test_a_budget_that_covers_the_positions_keeps_every_page_in_both_selectors(budget):
    """n = 50 positions in pages of 8 (the last one partial): a budget of n tokens or more keeps all
    7 pages in C as in Python (C kept budget // 8 = 6 before)."""
    s = np.random.default_rng(1).dirichlet(np.full(50, 0.5), size=(1, 2)).astype(np.float32)
    c = select_pages_native(s, 1, budget=budget, page_size=8, sinks=4, recent=8)
    py = select(s.astype(np.float64), 2, EvictionConfig(budget=budget, page_size=8, window=8, policy="page-entrokv"))
    assert c.shape == (1, 1, 7) and np.array_equal(c, py.pages)


def test_an_all_zero_head_ties_its_full_pages_and_the_lowest_win_in_both_selectors():
    """Found by benchmarks/fuzz.py: an all-zero head is uniform, so its full pages tie exactly; the
    Python page sums of 1/n_free (14 of them per page) came out one ulp apart on some pages, and
    Python kept page 4 where C kept page 0 (ties: lower page first)."""
    s = np.zeros((1, 1, 99), np.float32)
    cfg = EvictionConfig(budget=28, page_size=14, window=1, sinks=0, recent=1, policy="page-entrokv")
    py = select(s.astype(np.float64), 1, cfg).pages
    c = select_pages_native(s, 1, budget=28, page_size=14, sinks=0, recent=1)
    assert py.tolist() == c.tolist() == [[[0, 7]]]


def test_the_c_defaults_and_the_bindings_take_the_configurations_settings():
    """Page-EntroKV's settings live in EvictionConfig: the C library's default parameters (for C
    callers) hold the same values, and the bindings fill what a caller leaves out from the config."""
    from entrokv_edge.bindings.native import c_api
    _, lib = c_api()
    p = lib.llama_entrokv_default_params()
    cfg = EvictionConfig(policy="page-entrokv")
    assert (p.page_size, p.sinks, p.recent, p.tau, p.page_max) == (cfg.page_size, cfg.sinks, cfg.rho, cfg.tau, 0)
    s = np.random.default_rng(5).dirichlet(np.ones(200), size=(2, 6)).astype(np.float32)
    given_all = select_pages_native(s, 2, budget=64, page_size=cfg.page_size, sinks=cfg.sinks, recent=cfg.rho,
                                    tau=cfg.tau)
    assert np.array_equal(select_pages_native(s, 2, budget=64), given_all)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("extra", [{}, {"page_score": "max"}, {"consensus": 0.5, "value_power": 1.0},
                                   {"entropy_region": "evictable", "head_pool": "max"}, {"head_pool": "entropy"}])
def test_selecting_one_layer_at_a_time_is_the_same_selection(policy, extra):
    """The controller selects layer by layer (its working memory one layer's scores, not L layers' of the
    logical length): pages, weights, statistics and the heads' own pages equal the joint selection's,
    also with pages already gone from some group buffers."""
    from dataclasses import fields
    from entrokv_edge.controller.policies import select_layers
    from entrokv_edge.controller.stats import HeadSummary
    rng = np.random.default_rng(len(policy) + len(extra))
    L, H, r, n = 4, 6, 3, 301
    s = rng.random((L, H, n)) ** 6
    s[1, 2] = 0.0                                                    # an all-zero head
    s[2, 4, 4:] = 0.0                                                # a head all on its sinks
    values = rng.random((L, H // r, n)).astype(np.float32)
    extra = {} if policy != "entrokv-edge" and set(extra) - {"page_score", "value_power"} else extra
    cfg = EvictionConfig(budget=0.3, window=16, policy=policy, **extra)
    avail = None if policy == "full" else rng.random((L, H // r, cfg.n_pages(n))) > 0.2
    if avail is not None:
        avail[..., cfg.protected(n)] = True
    joint = select(s, r, cfg, n, available=avail, values=values)
    parts = select_layers(lambda l: s[l], L, r, cfg, n, available=avail, values=values)
    np.testing.assert_array_equal(parts.pages, joint.pages)
    np.testing.assert_array_equal(parts.head_pages, joint.head_pages)
    assert parts.n_budget == joint.n_budget
    assert (parts.weights is None) == (joint.weights is None)
    if joint.weights is not None:
        np.testing.assert_array_equal(parts.weights, joint.weights)
    for f in fields(HeadSummary):
        np.testing.assert_array_equal(getattr(parts.stats, f.name), getattr(joint.stats, f.name))
