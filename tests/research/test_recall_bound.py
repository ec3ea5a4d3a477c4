"""The recall simulation of benchmarks/research/recall_bound.py (issue 23's stage 1), on
constructed queries and keys: what it recalls, what it displaces, and that every (layer, KV
head) keeps exactly its budget."""
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "research"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def make_store(scorer_page=4):
    from recall_bound import Store
    rng = np.random.default_rng(0)
    n, T, d, G, r = 64, 72, 8, 2, 2                       # 64 document tokens, 8 more; 2 KV heads x 2 query heads
    k = {0: rng.normal(0, 0.1, (T, G, d)).astype(np.float32)}
    q = {0: rng.normal(0, 0.1, (T, G * r, d)).astype(np.float32)}
    k[0][40:44, 1] = 0.0
    k[0][40:44, 1, 0] = 8.0                               # KV head 1: page 10 (tokens 40-43) is what q looks for
    q[0][64:, 2:4, 0] = 8.0                               # KV head 1's query heads point at channel 0
    resident = np.array([np.r_[0:4, 8:28, 56:64], np.r_[0:4, 8:28, 56:64]])    # 32 of 64 each; 40-43 evicted
    protected = np.zeros(n, dtype=bool)
    protected[:4] = protected[56:] = True
    return Store(resident, q, k, np.array([0, 0]), np.array([0, 1]), n, r, 1 / np.sqrt(d), scorer_page, protected)


@pytest.mark.parametrize("scorer", ["exact", "digest", "shortlist", "centroid"])
def test_a_page_the_queries_look_for_comes_back_in_place_of_the_least_attended(scorer):
    st = make_store()
    before = st.resident.copy()
    st.recall(np.arange(64, 68), n_pages=2, scorer=scorer)
    assert st.resident.shape == before.shape                                  # exactly the budget, every slot
    assert all(np.all(np.diff(row) > 0) for row in st.resident)               # sorted, no duplicates
    assert set(range(40, 44)) <= set(st.resident[1])                          # the page the queries want
    came = [set(a) - set(b) for a, b in zip(st.resident, before)]
    gone = [set(b) - set(a) for a, b in zip(st.resident, before)]
    assert [len(c) for c in came] == [len(g) for g in gone] and st.recalled == sum(map(len, came))
    assert came[1] >= set(range(40, 44)) and all(not c & set(row) for c, row in zip(came, before))
    assert not set().union(*gone) & (set(range(4)) | set(range(56, 64)))     # sinks and recent stay

def test_nothing_is_recalled_when_no_page_beats_what_it_would_replace():
    st = make_store()
    st.q[0][64:, :, :] = 0.0                                                  # uniform attention: no page stands out
    before = st.resident.copy()
    st.recall(np.arange(64, 68), n_pages=4, scorer="exact")
    assert np.array_equal(st.resident, before) and st.recalled == 0


def test_the_shortlist_recalls_the_page_the_queries_attend_where_the_loose_bound_would_not():
    """Page 11 (tokens 44-47) spreads its keys over channels 0 and 1 (+-2, never both): the
    min/max bound of a query on both channels is twice page 10's, each key's own score zero. Page 10's keys
    are what the queries attend. With N = 1 the digest recalls page 11; the shortlist reads both
    (2 x N pages) and recalls page 10."""
    st = make_store()
    st.k[0][44:48, 1] = 0.0
    st.k[0][44:48:2, 1, 0], st.k[0][44:48:2, 1, 1] = 2.0, -2.0
    st.k[0][45:48:2, 1, 0], st.k[0][45:48:2, 1, 1] = -2.0, 2.0
    st.k[0][40:44, 1, :2] = 1.0
    st.q[0][64:, 2:4, :2] = 2.0
    digest, short = make_store(), make_store()
    for s in (digest, short):
        s.k, s.q = st.k, st.q
    short.shortlist = 2
    digest.recall(np.arange(64, 68), n_pages=1, scorer="digest")
    short.recall(np.arange(64, 68), n_pages=1, scorer="shortlist")
    assert set(range(44, 48)) <= set(digest.resident[1]) and not set(range(40, 44)) & set(digest.resident[1])
    assert set(range(40, 44)) <= set(short.resident[1]) and not set(range(44, 48)) & set(short.resident[1])


def test_merged_runs_keep_one_row_per_prompt_and_configuration_and_summarize_each_split_apart():
    from recall_bound import merge, summary
    row = lambda split, config, source, kl: {"model": "m", "split": split, "config": config, "source": source,  # noqa: E731
                                             "kind": "qa", "kl_mean": kl, "agreement": 1.0, "kept": True,
                                             "full_right": None}
    first = [row("tune", "no recall", "a", 0.5), row("tune", "head-independent", "a", 0.4),
             row("tune", "shortlist4 k4 N4", "a", 0.3)]
    first[0].pop("split")                                  # the first run's rows had no split: tune
    later = [row("tune", "no recall", "a", 0.6), row("heldout", "no recall", "b", 0.1),
             row("heldout", "shortlist4 k4 N4", "b", 0.2)]
    rows = merge(first, later)
    assert len(rows) == 5
    s = {(x["split"], x["config"]): x for x in summary(rows)}
    assert s["tune", "no recall"]["kl_mean"] == 0.6                             # the later run's row
    assert s["tune", "shortlist4 k4 N4"]["vs no recall"]["wins"] == 1
    assert s["heldout", "shortlist4 k4 N4"]["vs no recall"] == {"wins": 0, "losses": 1, "p": 1.0}
    assert s["heldout", "no recall"]["prompts"] == 1 and ("heldout", "head-independent") not in s


def test_the_digest_capture_is_one_for_a_digest_that_ranks_as_the_exact_scores_and_less_for_a_loose_bound():
    """recall_digest.capture_ratios on constructed keys: page 10 (tokens 40-43) holds what the
    queries look for, page 11 (44-47) spreads its keys over two channels (+-2, never both), so
    the min/max bound ranks it first while its keys score nothing. At M = 1 the page mean key
    picks page 10 (capture 1); min/max picks page 11 (capture well below 1)."""
    from recall_digest import capture_ratios
    rng = np.random.default_rng(1)
    n, s, T, d, r = 64, 4, 5, 8, 2
    k = rng.normal(0, 0.1, (n + s + T - 1, 1, d)).astype(np.float32)
    q = rng.normal(0, 0.1, (n + s + T - 1, r, d)).astype(np.float32)
    k[40:44, 0, :2] = 1.0
    k[44:48, 0, :2] = 0.0
    k[44:48:2, 0, 0], k[44:48:2, 0, 1] = 2.0, -2.0
    k[45:48:2, 0, 0], k[45:48:2, 0, 1] = -2.0, 2.0
    q[n:, :, :2] = 2.0
    a = {"q": {0: q}, "k": {0: k}, "resident": np.array([np.r_[0:4, 8:28, 56:64]]), "n": n, "s": s, "T": T,
         "slot_layer": np.array([0]), "slot_head": np.array([0])}
    cr = capture_ratios(a, window=4, k=4, page=4, ms=[1])
    assert cr["centroid"][1] == 1.0 and cr["reps2"][1] <= 1.0
    assert cr["minmax"][1] < 0.6


def test_the_decision_takes_the_cheapest_schedule_near_the_lowest_kl_under_the_read_cap():
    from recall_bound import decide
    vs = lambda w, lo: {"wins": w, "losses": lo, "p": 1.0}  # noqa: E731
    item = lambda config, kl, w=3, lo=1: {"model": "m", "split": "heldout", "config": config, "kl_mean": kl,  # noqa: E731
                                          "vs head-independent": vs(0, 0), "vs no recall": vs(w, lo)}
    summ = [item("head-independent", 0.30), item("no recall", 0.50, 0, 0),
            item("centroid2 k4 N16", 0.01),          # reads 32 pages: over the cap, not a candidate
            item("centroid2 k4 N8", 0.100), item("centroid2 k16 N8", 0.109), item("centroid2 k16 N4", 0.111),
            item("centroid2 k16 N2", 0.2), item("centroid1 k64 N1", 0.001)]   # another family
    d = decide(summ, "centroid2", cap=16)["m"]
    assert (d["config"], d["k"], d["N"], d["passes"]) == ("centroid2 k16 N8", 16, 8, True)
    summ[4] = item("centroid2 k16 N8", 0.109, w=2, lo=2)                     # as many losses as wins
    assert decide(summ, "centroid2", cap=16)["m"]["passes"] is False
    summ[0] = item("head-independent", 0.105)                                # below the chosen KL
    summ[4] = item("centroid2 k16 N8", 0.109)
    assert decide(summ, "centroid2", cap=16)["m"]["passes"] is False


@pytest.mark.parametrize("args, says", [(["--shard", "2/2"], "--shard takes I/N"), (["--shard", "x"], "--shard takes I/N"),
                                        (["--ns", "0"], "--ns must be at least 1"),
                                        (["--merge", "missing.json"], "--merge:")])
def test_bad_options_are_refused_before_anything_runs_or_is_written(tmp_path, args, says):
    import subprocess
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "research" / "recall_bound.py"), *args,
                        "--out", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and says in r.stderr and not out.exists()
