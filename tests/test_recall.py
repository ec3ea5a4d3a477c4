"""The recall tier (runtime/recall.py): evicted tokens kept in a store and swapped back while
generating. Checked on synthetic models against the rows the cache held before the eviction,
and on SmolLM2 on the follow-up question the tier exists for."""
import numpy as np
import pytest

import entrokv_edge as ek
from entrokv_edge.bindings import read_cells
from entrokv_edge.runtime.recall import RecallConfig
from helpers import logits

SETTINGS = dict(budget=64, page_size=8, window=16, verbose=False, seed=0, n_threads=2, n_threads_batch=2)
RECALL = dict(every=2, pages=4, page_size=8)


@pytest.fixture
def model(synth_models):
    return str(synth_models["llama-r3"])


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def slot_rows(llm, tp):
    """Per slot: {true position: (K row bytes, V row bytes)} of every cell the slot holds."""
    cells = [np.flatnonzero(t >= 0) for t in tp]
    k, v = read_cells(llm, cells)
    return [{int(tp[s][c]): (k[s][j].tobytes(), v[s][j].tobytes()) for j, c in enumerate(cells[s])}
            for s in range(len(tp))]


def decode(llm, n):
    for _ in range(n):
        llm.eval([int(np.argmax(logits(llm)))])


@pytest.mark.parametrize("type_k,where", [(0, "memory"), (1, "memory"), (8, "memory"), (1, "file")],
                         ids=["f32", "f16", "q8_0", "f16-file"])
def test_recalls_swap_exact_rows_and_lose_or_duplicate_no_token(model, type_k, where, tmp_path):
    recall = {**RECALL, "directory": str(tmp_path)} if where == "file" else RECALL
    llm = ek.EntroKVLlama(model, n_ctx=256, recall=recall, type_k=type_k, type_v=type_k, flash_attn=type_k == 8,
                          **SETTINGS)
    before = {}
    on_evict = llm.recall.on_evict

    def spy(l, tp, cells):                       # what every slot holds just before the eviction
        tp = ek.true_positions(l) if tp is None else tp
        before["rows"] = slot_rows(l, tp)
        on_evict(l, tp, cells)
    llm.recall.on_evict = spy
    llm.eval(prompt(200, 1))                     # fits the cache: one eviction, after the prompt
    assert llm.n_evictions == 1 and llm.recall.store.n_tokens == 200 - 64
    evicted_to = ek.true_positions(llm)[:, :64].copy()
    decode(llm, 40)                              # 40 more cells: no second eviction, 20 recalls
    rep = llm.kv_report()["recall"]
    assert llm.n_evictions == 1 and rep["recalls"] == 20 and rep["recalled_tokens"] > 0
    g = ek.geometry(llm)
    tp = ek.true_positions(llm)
    now = slot_rows(llm, tp[:, : g.n_compacted])
    st = llm.recall.store
    for s, rows in enumerate(before["rows"]):
        # the compacted cells and the store together hold the 200 prompt tokens once each, with their rows
        stored = {int(p): (st.k[s][j].tobytes(), st.v[s][j].tobytes()) for j, p in enumerate(st.pos[s])}
        assert len(stored) == st.pos[s].size and not set(stored) & set(now[s])
        assert {**stored, **now[s]} == rows, f"slot {s}"
        assert set(now[s]) >= set(range(4)) and set(now[s]) >= set(range(184, 200))   # sinks and recent stay
    assert g.n_compacted == 64 and g.n_used == 64 + 40                              # the budget, exactly
    assert len({len(p) for p in st.pos}) == 1
    rep = llm.kv_report()["recall"]
    assert rep["store_bytes_in_memory"] * 10 < rep["store_bytes"] if where == "file" else \
        rep["store_bytes_in_memory"] == rep["store_bytes"]          # in a file, only positions stay in memory
    assert list(tmp_path.iterdir()) == []            # the store's file has no name: nothing is left behind
    assert (np.sort(tp[:, :64], 1) != np.sort(evicted_to, 1)).any(axis=1).sum() > g.n_slots // 2   # pages came back


@pytest.mark.parametrize("where", ["memory", "file"])
def test_generation_with_recall_goes_on_across_evictions(model, where, tmp_path):
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, **({"directory": tmp_path} if where == "file" else {})},
                          **SETTINGS)
    llm.eval(prompt(600, 2))
    decode(llm, 400)                             # past the cache several times
    g, st = ek.geometry(llm), llm.recall.store
    assert llm.n_evictions >= 3 and llm.kv_report()["recall"]["recalled_tokens"] > 0
    tp = ek.true_positions(llm)
    for s in range(g.n_slots):                   # every position is held once: in the cache or in the store
        held = np.concatenate([tp[s][tp[s] >= 0], st.pos[s]])
        assert np.array_equal(np.sort(held), np.arange(1000)), f"slot {s}"


def test_sessions_keep_the_store_and_go_on_identically(model, tmp_path):
    a = ek.EntroKVLlama(model, n_ctx=256, recall=RECALL, **SETTINGS)
    a.eval(prompt(500, 3))
    decode(a, 7)
    a.save_session(tmp_path / "s.entrokv")
    b = ek.EntroKVLlama(model, n_ctx=256, recall=RECALL, **SETTINGS)
    b.load_session(tmp_path / "s.entrokv")
    for x, y in zip((a.recall.store.pos, a.recall.store.k, a.recall.store.v),
                    (b.recall.store.pos, b.recall.store.k, b.recall.store.v)):
        assert all(np.array_equal(p, q) for p, q in zip(x, y))
    for _ in range(60):                          # recalls and an eviction on the way, the same in both
        ta, tb = int(np.argmax(logits(a))), int(np.argmax(logits(b)))
        assert ta == tb
        a.eval([ta]), b.eval([tb])
    assert np.array_equal(ek.true_positions(a), ek.true_positions(b))
    assert a.kv_report()["recall"]["recalled_tokens"] > 0
    c = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)           # recall off: the cache loads, the store is left
    c.load_session(tmp_path / "s.entrokv")
    assert c.n_tokens == a.n_tokens - 60 and c.kv_report()["recall"] == {"on": False}


def test_recall_settings_are_checked(model):
    for bad in (dict(every=0), dict(pages=-1), dict(page_size=2.5), dict(nope=1), dict(directory="/no/such/dir")):
        with pytest.raises((ValueError, TypeError)):
            ek.EntroKVLlama(model, n_ctx=256, recall=bad, **SETTINGS)
    with pytest.raises(TypeError):
        ek.EntroKVLlama(model, n_ctx=256, recall="yes", **SETTINGS)
    assert ek.EntroKVLlama(model, n_ctx=256, recall=True, **SETTINGS).recall.config == RecallConfig()


def test_a_follow_up_question_finds_a_fact_the_first_turn_evicted(smollm2):
    """The issue's example: a ~600-token document with a password in the first turn, a 256-token
    budget, the question in the second turn. Without recall SmolLM2 answers wrongly."""
    from pathlib import Path
    words = (Path(__file__).parents[1] / "docs" / "sample.txt").read_text().split()
    doc = " ".join(words[:200]) + " The password for the blue safe is 4471. " + " ".join(words[200:420])
    answers = {}
    for recall in (False, True):
        llm = ek.EntroKVLlama(str(smollm2), n_ctx=512, budget=256, recall=recall, verbose=False, seed=0,
                              n_threads=2, n_threads_batch=2)
        msgs = [{"role": "user", "content": f"Here is a document:\n{doc}\nSummarize it in one sentence."}]
        r = llm.create_chat_completion(msgs, max_tokens=40, temperature=0)
        msgs += [r["choices"][0]["message"], {"role": "user", "content": "What is the password for the blue safe?"}]
        answers[recall] = llm.create_chat_completion(msgs, max_tokens=24, temperature=0)["choices"][0]["message"]["content"]
        assert llm.n_evictions >= 1
    assert "4471" in answers[True] and "4471" not in answers[False], answers
