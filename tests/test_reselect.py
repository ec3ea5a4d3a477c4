"""Reselect (controller/reselect.py): the eviction after a prompt read in pieces chooses among the cached
tokens and those the evictions between pieces set aside. Checked on a synthetic model against the
observer's own attention and against the rows the store held."""
import numpy as np
import pytest

import entrokv_edge as ek
from entrokv_edge.bindings import read_cells
from entrokv_edge.runtime.reselect import UnionScores, resident
from entrokv_edge.runtime.store import Store
from helpers import logits
from test_runtime import SETTINGS, model, prompt  # noqa: F401 - the synthetic model fixture, its settings, prompts


def final_evictions(llm):
    """Watch ``llm``'s evictions: for each eviction given set-aside tokens, what the cache and the store held
    just before it (true positions, rows) and its result."""
    seen = []

    def evicting(rt, controller, scores, aside):
        if aside is not None:
            st, tp = aside, ek.true_positions(rt)
            stored = [{int(p): (st.k[s][j].tobytes(), st.v[s][j].tobytes()) for j, p in enumerate(st.pos[s])}
                      for s in range(tp.shape[0])]
            seen.append({"tp": tp, "stored": stored, "scores": scores, "n": int(ek.geometry(rt).pos_max) + 1,
                         "digest_bytes": st.nbytes()["digests"]})

    def evicted(rt, controller, result):
        if seen and "res" not in seen[-1]:
            seen[-1]["res"] = result
    llm.events.listen("evicting", evicting)
    llm.events.listen("evicted", evicted)
    return seen


@pytest.mark.parametrize("type_k,chunk", [(0, None), (1, None), (1, 7)], ids=["f32", "f16", "f16-chunks"])
def test_a_reselect_brings_set_aside_tokens_back_with_their_exact_rows(model, type_k, chunk):
    settings = {k: v for k, v in SETTINGS.items() if k in ("budget", "page_size", "window")}
    runtime = {k: v for k, v in SETTINGS.items() if k not in settings}
    # with chunk, the rows move a few slots at a time: here a slot or two per step
    controller = ek.EvictionController(ek.EvictionConfig(**settings), **({"swap_rows": chunk} if chunk else {}))
    llm = ek.EntroKVLlama(model, n_ctx=256, type_k=type_k, type_v=type_k, eviction=controller, **runtime)
    seen = final_evictions(llm)
    llm.eval(prompt(1000, 3))
    rep = llm.kv_report()
    assert len(seen) == 1 and rep["evictions"] >= 4                # only the eviction after the prompt reselects
    res = seen[0]["res"]
    assert res.metrics["reselected"] and rep["reselected_tokens"] == res.metrics["reselected_tokens"] > 0
    assert llm._aside is None                                      # the read's store is gone with the read
    assert seen[0]["digest_bytes"] == 0                            # and it kept rows only (no recall digests)
    g = ek.geometry(llm)
    assert g.n_used == g.n_compacted == 64 == rep["kept_tokens"]   # the budget, exactly, in every buffer
    tp = ek.true_positions(llm)[:, :64]
    assert np.array_equal(np.sort(tp, 1), res.positions.reshape(g.n_slots, -1))    # what the selection chose
    cells = [np.arange(64, dtype=np.int32)] * g.n_slots
    k, v = read_cells(llm, cells)
    before = seen[0]["tp"]
    back = 0
    for s in range(g.n_slots):
        held = set(before[s][before[s] >= 0].tolist())
        for j, p in enumerate(tp[s].tolist()):
            if p not in held:                                      # came back from the store: its rows, exactly
                assert seen[0]["stored"][s][p] == (k[s][j].tobytes(), v[s][j].tobytes()), (s, p)
                back += 1
    assert back == rep["reselected_tokens"]
    assert (tp[:, :4] == np.arange(4)).all() and (np.sort(tp, 1)[:, -16:] == np.arange(984, 1000)).all()
    for _ in range(20):                                            # generation goes on from the cache as chosen
        llm.eval([int(np.argmax(logits(llm)))])
    assert llm.n_tokens == 1020


def test_the_union_scores_are_the_observers_attention_over_the_same_keys(model):
    """Scored over the cache's own tokens, some of them moved into a store, the union's scores equal the window
    scores the observer computed inside llama.cpp (no draft: its tokens' keys are gone when a reselect scores)."""
    checked = []

    def spy(rt, controller, scores, aside):
        llm, ws = rt, scores
        if aside is not None:                     # the cache as the eviction after the prompt finds it
            g, tp = ek.geometry(llm), ek.true_positions(llm)
            n, m = g.pos_max + 1, 20                  # the first m cells of each slot go to a store of their own
            k, v = read_cells(llm, [np.arange(m, dtype=np.int32)] * g.n_slots, g, buffers=True)
            lay = g.layers[0]
            st = Store(g.n_slots, 8, g.type_k, lay.k_bytes_per_cell // lay.n_head_kv,
                       lay.v_bytes_per_cell // lay.n_head_kv, lay.head_dim_k)
            kr, pr = resident(llm, g, tp, st)
            st.add(pr[:, :m], k.reshape(g.n_slots, m, -1), v.reshape(g.n_slots, m, -1))
            union = UnionScores(lambda s: kr(s)[:, m:], pr[:, m:], st, ws.queries, ws.pos_last, None, 0.0, n)
            L, H = ws.scores.shape[:2]
            present = union.present().reshape(L, -1, n)
            assert (present.sum(-1) == pr.shape[1]).all()
            for l in range(L):
                want = ek.EvictionController._layer_scores_by_position(ws, present, l, n, H, H // present.shape[1])
                assert np.allclose(union.layer(l), want, rtol=1e-4, atol=1e-7), l
            checked.append(L)
    llm = ek.EntroKVLlama(model, n_ctx=256, type_k=0, type_v=0, lookahead=0, **SETTINGS)
    llm.events.listen("evicting", spy)
    llm.eval(prompt(1000, 4))
    assert checked and checked[0] > 0


def test_with_recall_the_store_keeps_what_a_reselect_leaves_and_the_question_does_not_recall_again(model):
    llm = ek.EntroKVLlama(model, n_ctx=256, recall=dict(every=2, pages=4, page_size=8, turn_draft=0), **SETTINGS)
    llm.eval(prompt(700, 11))
    rep = llm.kv_report()
    assert rep["reselected_tokens"] > 0 and rep["recall"]["recalls"] == 0     # the question chose among everything
    tp, st = ek.true_positions(llm), llm.recall.store
    for s in range(tp.shape[0]):                                   # each position once: in the cache or the store
        held = np.concatenate([tp[s][tp[s] >= 0], st.pos[s]])
        assert np.array_equal(np.sort(held), np.arange(700)), s
    for _ in range(6):                                             # decoding recalls go on from there
        llm.eval([int(np.argmax(logits(llm)))])
    assert llm.kv_report()["recall"]["recalls"] == 3


def test_reselect_off_reads_as_before_and_the_option_is_checked(model):
    on = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    off = ek.EntroKVLlama(model, n_ctx=256, reselect=False, **SETTINGS)
    toks = prompt(1000, 5)
    on.eval(toks)
    off.eval(toks)
    assert on.config.reselect and off.kv_report()["reselected_tokens"] == 0 < on.kv_report()["reselected_tokens"]
    assert not off.last_eviction.metrics["reselected"]
    assert not np.array_equal(np.sort(ek.true_positions(on)[:, :64], 1), np.sort(ek.true_positions(off)[:, :64], 1))
    with pytest.raises(ValueError, match="reselect must be True or False"):
        ek.EvictionConfig(reselect="yes")
    with pytest.raises(ValueError, match="reselect=True"):
        ek.EvictionConfig(policy="page-entrokv", reselect=True)
    assert ek.EvictionConfig(policy="page-entrokv").reselect is False


def test_without_a_writable_temporary_directory_the_prompt_is_read_without_reselect(model, monkeypatch, tmp_path):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    llm = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    llm.eval(prompt(1000, 6))
    rep = llm.kv_report()
    assert rep["evictions"] >= 4 and rep["reselected_tokens"] == 0 and rep["kept_tokens"] == 64
    assert llm._aside is None and not llm.last_eviction.metrics["reselected"]
