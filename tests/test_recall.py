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


def assert_each_position_once(llm, n):
    """Every slot holds each of the positions 0..n-1 once: in the cache or in the recall's store."""
    tp, st = ek.true_positions(llm), llm.recall.store
    for s in range(tp.shape[0]):
        held = np.concatenate([tp[s][tp[s] >= 0], st.pos[s]])
        assert np.array_equal(np.sort(held), np.arange(n)), f"slot {s}"


def last_logits_are_fresh(llm, token) -> bool:
    """Whether the last logits equal the last token (``token``) removed and evaluated again by
    llama-cpp-python itself on the cache as it is (the oracle of a re-evaluation)."""
    import llama_cpp
    seen = logits(llm).copy()
    assert llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens - 1, -1)
    llm.n_tokens -= 1
    llama_cpp.Llama.eval(llm, [token])
    return np.array_equal(seen, logits(llm))


@pytest.mark.parametrize("type_k,where", [(0, "memory"), (1, "memory"), (8, "memory"), (2, "memory"), (1, "file")],
                         ids=["f32", "f16", "q8_0", "q4_0", "f16-file"])
def test_recalls_swap_exact_rows_and_lose_or_duplicate_no_token(model, type_k, where, tmp_path):
    recall = {**RECALL, "directory": str(tmp_path)} if where == "file" else RECALL
    llm = ek.EntroKVLlama(model, n_ctx=256, recall=recall, type_k=type_k, type_v=type_k, flash_attn=type_k in (2, 8),
                          **SETTINGS)
    before = {}

    def spy(rt, true_pos, cells):                # what every slot holds just before the eviction
        tp = ek.true_positions(rt) if true_pos is None else true_pos
        before["rows"] = slot_rows(rt, tp)
    llm.events.listen("compacting", spy)
    llm.eval(prompt(200, 1))                     # fits the cache: one eviction, after the prompt
    assert llm.stats.evictions == 1 and llm.recall.store.n_tokens == 200 - 64
    r0 = llm.kv_report()["recall"]["recalls"]
    assert r0 == 2                               # the turn's recall after the eviction (lookahead on), its draft's
    evicted_to = ek.true_positions(llm)[:, :64].copy()
    decode(llm, 40)                              # 40 more cells: no second eviction, 20 recalls
    rep = llm.kv_report()["recall"]
    assert llm.stats.evictions == 1 and rep["recalls"] == r0 + 20 and rep["recalled_tokens"] > 0
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
    # the resident keys kept between recalls ([S, n, d]) are the compacted cells' keys, as read now
    k, _ = read_cells(llm, [np.arange(64, dtype=np.int32)] * g.n_slots, keys_only=True)
    assert np.array_equal(llm.recall.keys.keys, st.keys(np.stack(k)))
    assert np.array_equal(llm.recall.keys.pos, tp[:, :64])
    # the entry table kept through the swaps is the one built afresh from the positions
    table = st.table().copy()
    st._table = None
    assert np.array_equal(table, st.table()) and (table >= 0).sum() == st.pos.size
    # the digests kept through the swaps: per page, the count and the mean of the keys the store holds now
    for s in range(g.n_slots):
        kf = st.keys(st.k[s]).astype(np.float64)
        pages = st.pos[s] // st.page
        count = np.bincount(pages, minlength=st.counts.shape[1])
        assert np.array_equal(st.counts[s], count)
        want = np.stack([kf[pages == p].mean(0) if c else np.zeros(kf.shape[1]) for p, c in enumerate(count)])
        assert np.allclose(st.means_t[s].T, want, rtol=1e-4, atol=1e-5), f"slot {s}"


@pytest.mark.parametrize("where", ["memory", "file"])
def test_generation_with_recall_goes_on_across_evictions(model, where, tmp_path):
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, **({"directory": tmp_path} if where == "file" else {})},
                          **SETTINGS)
    llm.eval(prompt(600, 2))
    decode(llm, 400)                             # past the cache several times
    assert llm.stats.evictions >= 3 and llm.kv_report()["recall"]["recalled_tokens"] > 0
    assert_each_position_once(llm, 1000)


def test_sessions_keep_the_store_and_go_on_identically(model, tmp_path):
    a = ek.EntroKVLlama(model, n_ctx=256, recall=RECALL, **SETTINGS)
    a.eval(prompt(500, 3))
    decode(a, 7)
    st = a.save_state()               # in memory (a server's cache of conversations): without the window's queries
    assert a._window_scores.queries is not None and st.window_scores.queries is None
    a.save_session(tmp_path / "s.entrokv")
    b = ek.EntroKVLlama(model, n_ctx=256, recall=RECALL, **SETTINGS)
    b.load_session(tmp_path / "s.entrokv")
    for x, y in zip((a.recall.store.pos, a.recall.store.k, a.recall.store.v),
                    (b.recall.store.pos, b.recall.store.k, b.recall.store.v)):
        assert all(np.array_equal(p, q) for p, q in zip(x, y))
    assert a.recall.steps and [x[1] for x in a.recall.steps] == [x[1] for x in b.recall.steps]   # mid-interval
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[2], y[2]) for x, y in zip(a.recall.steps, b.recall.steps))
    assert all(x[2] is not None for x in a.recall.steps)         # the steps' attention as the decode computed it
    for _ in range(60):                          # recalls and an eviction on the way, the same in both
        ta, tb = int(np.argmax(logits(a))), int(np.argmax(logits(b)))
        assert ta == tb
        a.eval([ta]), b.eval([tb])
    assert np.array_equal(ek.true_positions(a), ek.true_positions(b))
    assert a.kv_report()["recall"]["recalled_tokens"] > 0
    c = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)           # recall off: the cache loads, the store is left
    c.load_session(tmp_path / "s.entrokv")
    assert c.n_tokens == a.n_tokens - 60 and c.kv_report()["recall"] == {"on": False}


def test_a_recall_on_the_decodes_own_attention_decides_as_the_attention_computed_again(model, tmp_path):
    """A decoding recall takes each decoded token's attention from the decode itself (the decode observer's
    rows) instead of computing it again over every held key. On an F32 cache the two agree to rounding: one
    session, recalled with the steps' rows and, loaded again, without them (the attention computed), moves the
    same tokens into the same cells."""
    kw = {**SETTINGS, "type_k": 0, "type_v": 0}
    rc = {**RECALL, "every": 4096, "hold_draft": False}     # no recall until the test asks for one, no draft held
    a = ek.EntroKVLlama(model, n_ctx=256, recall=rc, **kw)
    a.eval(prompt(500, 4))
    decode(a, 6)
    assert len(a.recall.steps) == 6 and all(x[2] is not None and x[2].shape[2] == a.recall.n_keep
                                            for x in a.recall.steps)
    a.save_session(tmp_path / "s.entrokv")
    b = ek.EntroKVLlama(model, n_ctx=256, recall=rc, **kw)
    b.load_session(tmp_path / "s.entrokv")
    b.recall.steps = [(q, p, None) for q, p, _ in b.recall.steps]
    na, nb = a.recall.step(a), b.recall.step(b)
    assert na == nb > 0
    assert (a.stats.recalls_on_decode, b.stats.recalls_on_decode) == (1, 0)
    assert a.kv_report()["recall"]["recalls_on_decode_attention"] == 1
    assert np.array_equal(ek.true_positions(a), ek.true_positions(b))
    assert np.array_equal(a.recall.store.pos, b.recall.store.pos)
    # a saved attention that does not fit the cache is refused, as the rest of a store that does not fit
    decode(a, 2)
    saved = a.recall.arrays()
    g = ek.geometry(a)
    assert saved["recall_rows"].shape == (2, g.n_layers, saved["recall_q"].shape[2], a.recall.n_keep)   # [steps, L, H, n]
    for bad in (saved["recall_rows"][:, :, :, :-1], saved["recall_rows"][:1], saved["recall_rows"][0]):
        with pytest.raises(ValueError, match="observed attention"):
            a.recall.load(a, {**saved, "recall_rows": bad})
    a.recall.load(a, saved)                           # and the one that fits loads
    assert all(np.array_equal(x[2].reshape(r.shape), r) for x, r in zip(a.recall.steps, saved["recall_rows"]))


def test_a_recall_with_a_held_draft_takes_the_decoded_tokens_attention_from_the_decode(model, tmp_path):
    """A decoding recall whose queries include a held draft (not decoded, so without the decode's attention)
    takes the decoded tokens' attention from the decode and computes only the draft's. On an F32 cache the
    plan sees the same attention and log-sum-exps (to rounding), and moves the same tokens into the same
    cells, as the same session with every query's attention computed."""
    seen = []

    def plan(slots, att, lse, scale):            # what each plan receives
        seen.append((slots.copy(), att * (1.0 if scale is None else scale[..., None]), lse.copy()))
    kw = {**SETTINGS, "type_k": 0, "type_v": 0}
    rc = {**RECALL, "every": 4096, "turn_draft": 6}         # no recall until the test asks for one
    a = ek.EntroKVLlama(model, n_ctx=256, recall=rc, **kw)
    a.events.listen("recall_inputs", plan)
    a.eval(prompt(200, 4))
    decode(a, 5)
    a.eval(prompt(10, 5))                                   # a turn: its draft is held
    decode(a, 3)
    assert a.recall.held is not None and (a.recall.held[1] > a.recall.steps[-1][1]).sum() == 3
    assert len(a.recall.steps) == 3 and all(x[2] is not None for x in a.recall.steps)
    a.save_session(tmp_path / "s.entrokv")
    b = ek.EntroKVLlama(model, n_ctx=256, recall=rc, **kw)
    b.load_session(tmp_path / "s.entrokv")
    b.events.listen("recall_inputs", plan)
    b.recall.steps = [(q, p, None) for q, p, _ in b.recall.steps]
    before = (a.stats.recalls_on_decode, b.stats.recalls_on_decode)
    seen.clear()                                            # (the turns' recalls)
    na = a.recall.step(a)
    got, seen[:] = list(seen), []
    nb = b.recall.step(b)
    assert len(got) == len(seen) > 0
    for (s1, att1, lse1), (s2, att2, lse2) in zip(got, seen):
        assert np.array_equal(s1, s2) and att1.shape[1] == 6     # 3 decoded tokens, then the draft's 3 ahead
        assert np.allclose(att1, att2, rtol=1e-4, atol=1e-6) and np.allclose(lse1, lse2, atol=1e-4)
    assert na == nb > 0
    assert (a.stats.recalls_on_decode - before[0], b.stats.recalls_on_decode - before[1]) == (1, 0)
    assert np.array_equal(ek.true_positions(a), ek.true_positions(b))
    assert np.array_equal(a.recall.store.pos, b.recall.store.pos)


def test_steps_loaded_past_every_keep_their_attention_as_the_buffer_grows(model, tmp_path):
    """A session saved with more decoded steps than the loading instance's ``every``: the next step grows the
    steps' attention buffer, every step keeps its attention, and the recall uses the decode's."""
    kw = {**SETTINGS, "type_k": 0, "type_v": 0}
    a = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "every": 4096, "hold_draft": False}, **kw)
    a.eval(prompt(500, 4))
    decode(a, 6)
    a.save_session(tmp_path / "s.entrokv")
    b = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "every": 4, "hold_draft": False}, **kw)
    b.load_session(tmp_path / "s.entrokv")
    assert len(b.recall.steps) == 6 and b.recall._att.shape[1] == 6
    n0 = b.stats.recalls_on_decode
    decode(b, 1)                                  # a 7th step (the buffer grows), then the recall it makes due
    assert b.stats.recalls >= 1 and b.stats.recalls_on_decode == n0 + 1


def test_the_decoded_steps_attention_is_kept_within_its_bound(model):
    """The decoded steps keep their attention only while every step since the last recall has it and their
    bytes stay within the recall's rows_bytes; past it the earlier steps' are dropped too and the recall
    computes it."""
    a = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "every": 4096, "hold_draft": False}, **SETTINGS)
    a.eval(prompt(500, 4))
    decode(a, 2)
    one = a.recall.steps[0][2].nbytes
    assert all(x[2] is not None for x in a.recall.steps)
    a.recall.rows_bytes = 3 * one
    decode(a, 1)
    assert all(x[2] is not None for x in a.recall.steps) and len(a.recall.steps) == 3
    decode(a, 1)
    assert len(a.recall.steps) == 4 and all(x[2] is None for x in a.recall.steps)
    assert a.recall.step(a) > 0 and a.stats.recalls_on_decode == 0
    # the steps' attention is kept in one buffer, which never takes more than rows_bytes, whatever `every` is
    a.recall._att = None
    decode(a, 1)
    assert a.recall.steps[0][2] is not None and a.recall._att.nbytes <= a.recall.rows_bytes


def test_recall_settings_are_checked(model):
    for bad in (dict(every=0), dict(pages=-1), dict(page_size=2.5), dict(nope=1), dict(directory="/no/such/dir"),
                dict(turn_draft=-1), dict(turn_draft=65), dict(turn_draft=True),
                dict(turn_pages=4097), dict(every=True), dict(hold_draft=1), dict(turn_requery=None)):
        with pytest.raises((ValueError, TypeError)):
            ek.EntroKVLlama(model, n_ctx=256, recall=bad, **SETTINGS)
    with pytest.raises(TypeError):
        ek.EntroKVLlama(model, n_ctx=256, recall="yes", **SETTINGS)
    assert ek.EntroKVLlama(model, n_ctx=256, recall=True, **SETTINGS).recall.config == RecallConfig()


def test_the_answer_starts_from_the_cache_as_recalled_with_or_without_a_turn_draft(model):
    """A turn's recall that moves tokens leaves the turn's last logits as its last token evaluated on the
    cache as recalled (not the ones computed before the recall). With turn_draft, the answer's first
    tokens are drafted, drive a second recall and leave again."""
    fresh = {}
    for k in (0, 6):
        llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": k}, **SETTINGS)
        llm.eval(prompt(200, 4))
        decode(llm, 5)
        n0, rep0 = llm.n_tokens, llm.kv_report()["recall"]
        recalls = rep0["recalls"]
        turn = prompt(10, 5)
        llm.eval(turn)                                       # shorter than the window: a turn, recalled for
        rep = llm.kv_report()["recall"]
        assert llm.n_tokens == n0 + 10 and ek.geometry(llm).n_used == 64 + 5 + 10        # the draft's cells are gone
        # the turn's recall, its requery's, the draft's
        assert rep["drafted_tokens"] == rep0["drafted_tokens"] + k and rep["recalls"] == recalls + 2 + (k > 0)
        assert_each_position_once(llm, n0 + 10)
        fresh[k] = last_logits_are_fresh(llm, turn[-1])
        assert rep["recalled_tokens"] > 0
    assert fresh == {0: True, 6: True}


def test_a_held_draft_joins_the_decoding_recalls_until_the_answer_passes_it(model, tmp_path):
    """hold_draft (on by default): after a turn's draft, each decoding recall's queries are the tokens
    decoded since the last recall plus the draft's queries at positions not decoded yet, and the draft
    is dropped once the answer has passed it; a session saved mid-answer keeps it."""
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": 6}, **SETTINGS)
    llm.eval(prompt(200, 4))
    decode(llm, 5)
    n = llm.n_tokens + 10
    llm.eval(prompt(10, 5))                                   # a turn: its recall, then the draft's
    hq, hpos = llm.recall.held
    assert hq.shape[1] == 6 and np.array_equal(hpos, np.arange(n, n + 6))
    seen = []
    stop = llm.events.listen("recalling", lambda queries, qpos, n_pages, att: seen.append((queries.copy(), qpos.copy(),
                                                                                          att)))
    decode(llm, 2)                                            # every=2: one recall, after positions n, n + 1
    llm.save_session(tmp_path / "s.entrokv")
    decode(llm, 6)
    stop()
    q, qpos, att = seen[0]
    assert qpos.tolist() == [n, n + 1, n + 2, n + 3, n + 4, n + 5]        # decoded, then the draft ahead
    # the decoded tokens' attention as the decode computed it; the draft's (not decoded) is computed
    assert att is not None and att.shape[1] == 2 and all(x[2] is not None and x[2].shape[1] == 2 for x in seen)
    assert np.array_equal(q[:, 2:], hq[:, 2:])
    assert seen[1][1].tolist() == [n + 2, n + 3, n + 4, n + 5]
    assert seen[2][1].tolist() == [n + 4, n + 5] and llm.recall.held is None     # passed: dropped
    assert seen[3][1].tolist() == [n + 6, n + 7]
    b = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": 6}, **SETTINGS)
    b.load_session(tmp_path / "s.entrokv")
    assert np.array_equal(b.recall.held[0], hq) and np.array_equal(b.recall.held[1], hpos)
    c = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": 6, "hold_draft": False}, **SETTINGS)
    c.load_session(tmp_path / "s.entrokv")                    # the option off: nothing held
    assert c.recall.held is None


def test_turn_requery_evaluates_the_window_again_on_the_recalled_cache(model):
    """turn_requery (on by default): after a turn's recall that moves tokens, the turn's window is
    evaluated again on the recalled cache and its new queries drive a second recall. Layer 0's queries do
    not depend on the cache (the same both times); deeper layers' do. The cache keeps every position once
    and the last logits are the last token's on the cache as finally recalled."""
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": 0}, **SETTINGS)
    llm.eval(prompt(200, 4))
    decode(llm, 5)
    n0, recalls = llm.n_tokens, llm.kv_report()["recall"]["recalls"]
    seen = []
    stop = llm.events.listen("recalling", lambda queries, qpos, n_pages, att: seen.append((queries.copy(), qpos.copy())))
    turn = prompt(10, 5)                                      # shorter than the window: observed whole
    llm.eval(turn)
    stop()
    assert len(seen) == 2 and llm.kv_report()["recall"]["recalls"] == recalls + 2
    (q1, p1), (q2, p2) = seen
    assert np.array_equal(p1, np.arange(n0, n0 + 10)) and np.array_equal(p1, p2)
    assert np.allclose(q1[0], q2[0], atol=1e-5) and not np.allclose(q1[1:], q2[1:], atol=1e-3)
    assert llm.n_tokens == n0 + 10 and ek.geometry(llm).n_used == 64 + 5 + 10
    assert_each_position_once(llm, n0 + 10)
    assert last_logits_are_fresh(llm, turn[-1])
    # off: the turn's one recall
    off = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": 0, "turn_requery": False}, **SETTINGS)
    off.eval(prompt(200, 4))
    decode(off, 5)
    before = off.kv_report()["recall"]["recalls"]
    off.eval(turn)
    assert off.kv_report()["recall"]["recalls"] == before + 1


def test_a_failed_requery_puts_the_turns_window_back(model):
    """If the window's re-evaluation fails, the error reaches the caller and the window is in the cache
    again (evaluated once more, unobserved): no token of the turn is lost."""
    import llama_cpp
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": 0}, **SETTINGS)
    llm.eval(prompt(200, 4))
    decode(llm, 5)
    n0, turn = llm.n_tokens, prompt(10, 5)
    real, calls = llama_cpp.Llama.eval, []

    def failing(self, tokens):
        calls.append(len(tokens))
        if len(calls) == 2:             # the first: the turn itself; the second: its window again
            raise RuntimeError("decode failed")
        return real(self, tokens)
    llama_cpp.Llama.eval = failing
    try:
        with pytest.raises(RuntimeError, match="decode failed"):
            llm.eval(turn)
    finally:
        llama_cpp.Llama.eval = real
    assert calls == [10, 10, 10] and llm.n_tokens == n0 + 10
    assert ek.geometry(llm).n_used == 64 + 5 + 10
    assert_each_position_once(llm, n0 + 10)
    decode(llm, 3)                      # and generation goes on from there
    assert llm.n_tokens == n0 + 13


def test_a_follow_up_question_brings_back_the_fact_the_first_turn_evicted(smollm2):
    """The issue's example: a ~600-token document with a password in the first turn, a 256-token
    budget, the question as the second turn. The question's recall brings the password's tokens
    back into buffers that had lost them; without recall they stay lost."""
    from pathlib import Path
    words = (Path(__file__).parents[1] / "docs" / "sample.txt").read_text().split()
    doc = " ".join(words[:200]) + " The password for the blue safe is 4471. " + " ".join(words[200:420])
    held = {}
    for recall in (False, True):
        llm = ek.EntroKVLlama(str(smollm2), n_ctx=512, budget=256, recall=recall, verbose=False, seed=0,
                              n_threads=2, n_threads_batch=2)
        msgs = [{"role": "user", "content": f"Here is a document:\n{doc}\nSummarize it in one sentence."}]
        r = llm.create_chat_completion(msgs, max_tokens=16, temperature=0)
        ids = list(llm.input_ids[: llm.n_tokens])
        digits = llm.tokenize(b" 4471", add_bos=False)
        at = next(i for i in range(len(ids)) if ids[i: i + len(digits)] == digits)
        fact = set(range(at, at + len(digits)))
        before = (np.isin(ek.true_positions(llm), list(fact))).sum()
        msgs += [r["choices"][0]["message"], {"role": "user", "content": "What is the password for the blue safe?"}]
        llm.create_chat_completion(msgs, max_tokens=1, temperature=0)     # the turn, then one token
        held[recall] = (before, int(np.isin(ek.true_positions(llm), list(fact)).sum()))
        assert llm.stats.evictions >= 1
    assert held[False][1] <= held[False][0]                # without recall: nothing comes back
    assert held[True][1] > held[True][0] + 10, held        # the question's recall brings the digits back


def reference_plan(st, s, q, att, lse_res, tp, protect, P, N):
    """One slot's swaps, written plainly (loops): the oracle of recall.plan."""
    counts, pos = st.counts[s], st.pos[s]
    live = np.flatnonzero(counts > 0)
    mean = st.sums[s][live] / counts[live, None]
    est = np.einsum("ird,pd->irp", q, mean)
    mass = np.minimum(1.0, counts[live] * np.exp(est - lse_res[:, :, None])).sum(0).max(0)

    short = live[np.argsort(-mass, kind="stable")[:N]]
    ents = {p: [j for j in range(pos.size) if pos[j] // st.page == p] for p in short}
    kf = {j: np.frombuffer(st.k[s][j].tobytes(), np.float32).astype(np.float64) for p in short for j in ents[p]}
    logits = {j: q @ kf[j] for j in kf}                                  # [I, r] each
    lse_read = np.log(sum(np.exp(x) for x in logits.values()))
    lse_seen = np.logaddexp(lse_res, lse_read)
    score = {p: max(sum(np.exp(logits[j] - lse_seen)[:, h].sum() for j in ents[p]) for h in range(q.shape[1]))
             for p in short}
    res = (att * np.exp(lse_res - lse_seen)[:, :, None]).sum(0).max(0)
    groups = {}
    for c, t in enumerate(tp):
        groups.setdefault(t // P, []).append(c)
    free = sorted((sum(res[c] for c in cs), g) for g, cs in groups.items() if len(cs) == P and not protect[g])
    cells, taken = [], []
    for p in sorted(short, key=lambda p: -score[p]):
        k = len(ents[p]) // P
        out = free[:k]
        if len(out) < k or not score[p] > sum(x for x, _ in out):
            break
        free = free[k:]
        cells += [c for _, g in out for c in groups[g]]
        taken += ents[p]
    return sorted(cells), sorted(taken)


def test_the_plan_of_all_slots_matches_a_plain_one_slot_plan():
    """recall.plan over all slots at once against reference_plan."""
    from entrokv_edge.runtime.recall.swap import plan
    from entrokv_edge.runtime.store import Store
    rng = np.random.default_rng(0)
    S, I, r, d, P, page, N, n = 6, 4, 3, 8, 4, 16, 5, 640
    st = Store(S, page, "f32", 4 * d, 4 * d, d)
    resident, stored = [], []
    for s in range(S):       # every slot: 40 whole eviction pages resident (some protected), the rest stored
        pages = rng.permutation(n // P)
        resident.append(np.sort(np.concatenate([np.arange(p * P, p * P + P) for p in pages[:40]])))
        stored.append(np.concatenate([np.arange(p * P, p * P + P) for p in pages[40:]]))
    keys = rng.normal(size=(S, n - 160, d)).astype(np.float32)
    st.add(np.stack(stored), keys.view(np.uint8).reshape(S, n - 160, 4 * d), np.zeros((S, n - 160, 4), np.uint8))
    tp = np.stack([rng.permutation(x) for x in resident])          # cells hold resident tokens in any order
    q = rng.normal(size=(S, I, r, d)) * 0.2
    att = rng.dirichlet(np.ones(tp.shape[1]) * 50, size=(S, I, r)) * 0.8
    lse = rng.normal(size=(S, I, r)) + 6.0                     # pages and resident tokens close: some slots stop early
    protect = np.zeros(n // P + 2, bool)
    protect[[0, 1, n // P - 1]] = True
    cells, si, e, kf = plan(st, np.arange(S), q, att, lse, tp, protect, P, N)
    pages_in = []
    for s in range(S):
        want_cells, want_entries = reference_plan(st, s, q[s], att[s], lse[s], tp[s], protect, P, N)
        assert sorted(cells[s].tolist()) == want_cells and sorted(e[si == s].tolist()) == want_entries, f"slot {s}"
        assert want_entries == [] or np.array_equal(kf[si == s], keys[s][e[si == s]])
        pages_in.append(len({int(p) // page for p in st.pos[s][want_entries]}))
    # the comparison covers slots that took pages and slots whose resident tokens won before N pages came in
    assert max(pages_in) > 0 and min(pages_in) < N, pages_in


def reference_decision(att, w_cache, w_read, ent, tp, protect, P, page, max_groups):
    """llama_entrokv_recall_plan for one slot, written plainly (float64, loops): (read pages taken, cells
    displaced), both in order."""
    r, n_read = att.shape[1], w_read.shape[-1]
    valid = ent >= 0
    total = w_cache + (w_read * valid).sum(-1)                                   # [I, r]
    tok = (w_read * valid / total[..., None]).sum(0)                              # [r, n_read]
    pages = range(n_read // page)
    count = {p: int(valid[p * page:(p + 1) * page].sum()) for p in pages}
    score = {p: max(tok[h, p * page:(p + 1) * page].sum() for h in range(r)) if count[p] else -np.inf for p in pages}
    res = (att * (w_cache / total)[..., None]).sum(0).max(0)                     # [n_keep]
    groups = {}
    for c, t in enumerate(tp):
        groups.setdefault(int(t) // P, []).append(c)
    free = sorted((sum(res[c] for c in cs), g) for g, cs in groups.items()
                  if len(cs) == P and not (g < len(protect) and protect[g]))[:max_groups]
    taken, cells = [], []
    for p in sorted(pages, key=lambda p: (-score[p], p)):
        k = count[p] // P
        if count[p] == 0 or count[p] % P or k > len(free) or not score[p] > sum(x for x, _ in free[:k]):
            break
        taken.append(p)
        cells += [c for _, g in free[:k] for c in sorted(groups[g], key=lambda c: tp[c])]
        free = free[k:]
    return taken, cells


def _decide(att, w_cache, w_read, ent, tp, protect, P, page, G, scale=None):
    from entrokv_edge.bindings import recall_plan
    pages, n_pages, cells, n_cells = recall_plan(att, w_cache, w_read, ent, tp, protect, P, page, G, scale)
    return [(pages[s, :n_pages[s]].tolist(), cells[s, :n_cells[s]].tolist()) for s in range(att.shape[0])]


@pytest.mark.parametrize("n_keep, n_pos", [(60, 72), (1100, 1200)])
def test_the_native_swap_decision_matches_a_plain_one(n_keep, n_pos):
    """llama_entrokv_recall_plan against reference_decision on random slots: read pages with missing tokens (a
    partial page stops a slot), resident eviction pages that are not whole or are protected, the cap on
    displaced pages, att given as a slice of a wider array (its rows apart) and dense; cells fewer than the
    resident mass's block of 512 and more (three blocks, the last not a multiple of 8)."""
    rng = np.random.default_rng(1)
    S, I, r, P, page = 40, 3, 2, 2, 8
    protect = np.zeros(n_pos // P, bool)
    protect[[0, 1, 2, 30]] = True
    tp = np.stack([rng.choice(n_pos, n_keep, replace=False) for _ in range(S)]).astype(np.int32)
    wide = rng.dirichlet(np.ones(n_keep + 7), size=(S, I, r)).astype(np.float32)
    att = wide[..., :n_keep]                                  # rows n_keep + 7 floats apart
    n_read = 5 * page
    ent = np.where(rng.random((S, n_read)) < 0.9, np.arange(n_read), -1)
    ent[::3] = np.arange(n_read)                              # every third slot: whole pages only
    w_read = (rng.random((S, I, r, n_read)) * rng.choice([0.01, 0.1, 1.0], size=(S, 1, 1, 1))).astype(np.float32)
    w_cache = rng.uniform(0.5, 1.0, (S, I, r)).astype(np.float32)
    taken = {}
    for G in (6, 40):
        got = _decide(att, w_cache, w_read, ent, tp, protect, P, page, G)
        assert got == _decide(np.ascontiguousarray(att), w_cache, w_read, ent, tp, protect, P, page, G)
        scale = np.float32(2.0) ** rng.integers(-3, 4, size=(S, I, r)).astype(np.float32)     # exact in binary
        assert got == _decide(att / scale[..., None], w_cache, w_read, ent, tp, protect, P, page, G, scale)
        for s in range(S):
            assert got[s] == reference_decision(att[s].astype(np.float64), w_cache[s].astype(np.float64),
                                                w_read[s].astype(np.float64), ent[s], tp[s], protect, P, page, G), s
        taken[G] = [len(x[0]) for x in got]
    # slots that swap several pages and slots that swap none; the cap on displaced pages binds
    assert max(taken[40]) >= 2 and min(taken[40]) == 0 and sum(taken[6]) < sum(taken[40]), taken


def test_the_native_swap_decision_breaks_ties_by_the_lower_page():
    """Exact ties (dyadic weights): among equally attended resident eviction pages the lower true position goes
    first, among equally attended read pages the lower page comes in first."""
    P, page, n_keep = 2, 4, 16
    tp = np.array([[9, 8, 3, 2, 15, 14, 5, 4, 1, 0, 7, 6, 13, 12, 11, 10]], np.int32)     # eviction pages 0..7
    att = np.full((1, 1, 1, n_keep), 1 / 64, np.float32)       # every eviction page the same mass
    att[0, 0, 0, [4, 5]] = 1 / 8                               # page 7 (positions 14, 15) attended more
    w_read = np.full((1, 1, 1, 3 * page), 1 / 8, np.float32)   # three read pages of the same mass
    ent = np.arange(3 * page)[None, :]
    w_cache = np.ones((1, 1, 1), np.float32)                   # total 1 + 12/8: exact in binary
    protect = np.array([True])                                 # eviction page 0 (positions 0, 1) never displaced
    [(pages, cells)] = _decide(att, w_cache, w_read, ent, tp, protect, P, page, 16)
    assert pages == [0, 1, 2]
    pos = tp[0][cells].tolist()
    assert pos == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]    # pages 1..6 by position; 0 protected, 7 kept
    assert (pages, cells) == reference_decision(att[0].astype(np.float64), w_cache[0].astype(np.float64),
                                                w_read[0].astype(np.float64), ent[0], tp[0], protect, P, page, 16)


def test_the_native_swap_decision_refuses_bad_input():
    from entrokv_edge.bindings import EntroKVError, recall_plan
    att = np.full((1, 1, 1, 4), 0.25, np.float32)
    ok = dict(w_cache=np.ones((1, 1, 1), np.float32), w_read=np.ones((1, 1, 1, 4), np.float32), ent=np.arange(4)[None],
              true_pos=np.arange(4, dtype=np.int32)[None], protect=np.zeros(2, bool), page_size=2, store_page=4,
              max_groups=2)
    recall_plan(att, **ok)
    for bad, err in ((dict(w_cache=np.full((1, 1, 1), np.nan, np.float32)), EntroKVError),
                     (dict(w_read=np.full((1, 1, 1, 4), np.inf, np.float32)), EntroKVError),
                     (dict(true_pos=np.array([[0, 1, -1, 3]], np.int32)), ValueError),
                     (dict(true_pos=np.array([[0, 1, 1, 3]], np.int32)), EntroKVError),          # held twice
                     (dict(true_pos=np.array([[0, 1, 2, 2**31 - 1]], np.int32)), EntroKVError),  # no table that large
                     (dict(true_pos=np.array([[0, 1, 2, 2**32]])), ValueError),                  # not an int32
                     (dict(att_scale=np.full((1, 1, 1), np.nan, np.float32)), EntroKVError),
                     (dict(store_page=3), EntroKVError),
                     (dict(max_groups=-1), EntroKVError),
                     (dict(ent=np.arange(3)[None]), ValueError),
                     (dict(w_cache=np.ones((1, 2, 1), np.float32)), ValueError)):
        with pytest.raises(err):
            recall_plan(att, **{**ok, **bad})


def reference_rank(q, lse, means_t, counts, N):
    """llama_entrokv_recall_rank for one slot, written plainly (float64): the N pages of largest mass among
    those with a token, ties to the lower page, -1 past them."""
    live = [p for p in range(counts.size) if counts[p] > 0]
    mass = {p: max(sum(min(1.0, counts[p] * np.exp(float(q[i, h] @ means_t[:, p]) - lse[i, h]))
                       for i in range(q.shape[0])) for h in range(q.shape[1])) for p in live}
    top = sorted(live, key=lambda p: (-mass[p], p))[:N]
    return top + [-1] * (N - len(top))


def test_the_native_digest_ranking_matches_a_plain_one():
    """llama_entrokv_recall_rank against reference_rank: recalls of 1 to 9 tokens (blocks of 4 queries and a
    part block), pages that are not whole blocks of 16, empty pages, fewer pages than asked for, the means
    as a view whose rows lie apart; ties (equal pages, and masses capped at 1 per query) go to the lower page."""
    from entrokv_edge.bindings import recall_rank
    rng = np.random.default_rng(3)
    for trial in range(30):
        S, I, r, d = int(rng.integers(1, 5)), int(rng.integers(1, 10)), int(rng.integers(1, 5)), int(rng.integers(1, 20))
        n, N = int(rng.integers(1, 70)), int(rng.integers(1, 12))
        wide = rng.normal(size=(S, d, n + 5)).astype(np.float32)
        means_t = wide[:, :, 2: n + 2]                                # rows n + 5 floats apart
        counts = rng.integers(0, 17, (S, n))
        counts[:, rng.random(n) < 0.3] = 0
        if trial % 3 == 0 and n > 3:                                   # a repeated page: a tie, to the lower one
            means_t[:, :, 3], counts[:, 3] = means_t[:, :, 1], counts[:, 1]
        q = rng.normal(size=(S, I, r, d)).astype(np.float32)
        lse = (rng.normal(size=(S, I, r)) + (3.0 if trial % 5 else -30.0)).astype(np.float32)   # -30: masses capped
        got = recall_rank(q, lse, means_t, counts, N)
        assert got.shape == (S, N) and got.dtype == np.int32
        for s in range(S):
            assert got[s].tolist() == reference_rank(q[s].astype(np.float64), lse[s].astype(np.float64),
                                                     means_t[s].astype(np.float64), counts[s], N), (trial, s)


def test_the_native_digest_ranking_refuses_bad_input():
    from entrokv_edge.bindings import EntroKVError, recall_rank
    q, lse = np.zeros((2, 3, 2, 4), np.float32), np.zeros((2, 3, 2), np.float32)
    means, counts = np.zeros((2, 4, 5), np.float32), np.ones((2, 5), np.int32)
    assert recall_rank(q, lse, means, counts, 2).shape == (2, 2)
    for bad, err in ((dict(lse=np.full((2, 3, 2), np.nan, np.float32)), EntroKVError),
                     (dict(q=np.full((2, 3, 2, 4), np.inf, np.float32)), EntroKVError),
                     (dict(counts=-np.ones((2, 5), np.int32)), EntroKVError),
                     (dict(counts=np.full((2, 5), 2**31 - 1, np.int32)), EntroKVError),
                     (dict(n_out=0), EntroKVError),
                     (dict(lse=np.zeros((2, 3, 1), np.float32)), ValueError),
                     (dict(means_t=np.zeros((2, 3, 5), np.float32)), ValueError),
                     (dict(counts=np.ones((2, 4), np.int32)), ValueError),
                     (dict(q=np.zeros((2, 3, 4), np.float32)), ValueError)):
        args = {**dict(q=q, lse=lse, means_t=means, counts=counts, n_out=2), **bad}
        with pytest.raises(err):
            recall_rank(**args)


def test_the_native_softmax_matches_numpys_in_place():
    """llama_entrokv_softmax_rows against numpy: rows of a view whose rows lie apart (only they change), masked
    (-inf) entries exactly 0, rows shorter and longer than a vector, large and tiny logits; a row with a NaN
    or with nothing finite is refused."""
    from entrokv_edge.bindings import EntroKVError, softmax_rows
    rng = np.random.default_rng(4)
    for n in (1, 5, 8, 13, 300):
        wide = (rng.normal(size=(3, 4, 2, n + 7)) * 20).astype(np.float32)
        wide[..., :n][rng.random((3, 4, 2, n)) < 0.3] = -np.inf
        wide[..., 3] = rng.normal(size=(3, 4, 2)).astype(np.float32)          # every row of x keeps a finite value
        x = wide.reshape(3, 8, n + 7)[:, 2:, 3: n + 3]                         # [3, 6, n], rows n + 7 apart
        before = wide.copy()
        want = x.astype(np.float64)
        masked = np.isinf(want)
        m = want.max(-1, keepdims=True)
        e = np.exp(want - m)
        lse, inv = softmax_rows(x)
        assert np.allclose(x, e, rtol=1e-5, atol=1e-37) and (x[masked] == 0).all()   # (below e^-87: 0)
        assert np.allclose(lse, (m[..., 0] + np.log(e.sum(-1))), rtol=1e-6, atol=1e-5)
        assert np.allclose(inv, 1 / e.sum(-1), rtol=1e-5)
        outside = np.ones(wide.shape, bool)
        outside.reshape(3, 8, n + 7)[:, 2:, 3: n + 3] = False
        assert np.array_equal(wide[outside], before[outside])                # nothing else written
    for bad in (np.array([[[0.0, np.nan, 1.0]]], np.float32), np.full((1, 2, 9), -np.inf, np.float32),
                np.array([[[0.0, np.inf, 1.0]]], np.float32)):
        with pytest.raises(EntroKVError):
            softmax_rows(bad)
    with pytest.raises(ValueError):
        softmax_rows(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError):
        softmax_rows(np.zeros((1, 2, 3), np.float64))


def test_the_kernels_plain_paths_pass_the_same_checks():
    """With ENTROKV_NO_SIMD=1 the kernels take their plain C++ paths (what a CPU without AVX2, FMA or F16C
    runs): the ranking, the softmax, the swap decision and F16 to float pass the same checks there. On a CPU
    with AVX2 the softmax's sums then differ in their last bits from this process's (8 lanes summed apart):
    the plain path did run."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    from entrokv_edge.bindings import softmax_rows
    code = ("import numpy as np; from entrokv_edge.bindings import softmax_rows; "
            "x = np.random.default_rng(9).normal(size=(1, 4, 1000)).astype(np.float32); "
            "print('inv', softmax_rows(x)[1].tobytes().hex())")
    env = {**os.environ, "ENTROKV_NO_SIMD": "1"}
    here = Path(__file__).resolve()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here),
                        str(here.parent / "test_rows.py"), "-k",
                        "native_digest_ranking_matches or native_softmax_matches or rows_to_float "
                        "or native_swap_decision_matches"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=here.parent)
    assert r.returncode == 0 and re.search(r"^7 passed", r.stdout, re.M), r.stdout[-2000:] + r.stderr[-2000:]
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    x = np.random.default_rng(9).normal(size=(1, 4, 1000)).astype(np.float32)
    here_inv = softmax_rows(x)[1].tobytes().hex()
    assert plain.returncode == 0 and plain.stdout.startswith("inv "), plain.stderr
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" in flags and " fma" in flags:
        assert plain.stdout.split()[1] != here_inv


def test_a_file_store_reads_and_writes_the_rows_a_memory_store_does(tmp_path):
    """_Rows in a file (positioned reads merged across small gaps, writes per run of adjacent rows)
    against _Rows in memory: the same segments, random gathers in any order and with repeats, and
    scatters, give the same bytes."""
    import tempfile
    from entrokv_edge.runtime.store import _Rows
    rng = np.random.default_rng(3)
    with tempfile.TemporaryFile(dir=tmp_path) as f:
        mem, fil = _Rows(5, 24), _Rows(5, 24, f)
        for m in (7, 1, 30, 12):
            block = rng.integers(0, 256, (5, m, 24), dtype=np.uint8)
            mem.append(block)
            fil.append(block)
        for _ in range(20):
            n = int(rng.integers(1, 60))
            si, e = rng.integers(0, 5, (2, n)), rng.integers(0, mem.n, (2, n))
            assert np.array_equal(fil.gather(si, e), mem.gather(si, e))
            pick = np.unique(si[0] * mem.n + e[0])                        # distinct entries to overwrite
            s2, e2 = pick // mem.n, pick % mem.n
            rows = rng.integers(0, 256, (pick.size, 24), dtype=np.uint8)
            mem.scatter(s2, e2, rows)
            fil.scatter(s2, e2, rows)
        for s in range(5):
            assert np.array_equal(fil[s], mem[s])
        assert fil.gather(np.zeros((0,), int), np.zeros((0,), int)).shape == (0, 24)


def test_a_store_whose_file_cannot_grow_stays_as_it_was(tmp_path):
    """A file store that cannot be written (RLIMIT_FSIZE, as a full disk: EFBIG) refuses the new
    tokens with OSError and keeps what it held: positions, digests and rows. Run in a child process,
    which the limit would otherwise follow."""
    import subprocess
    import sys
    code = f"""
import resource, signal, numpy as np
from entrokv_edge.runtime.store import Store
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
st = Store(3, 4, "f32", 32, 32, 8, directory={str(tmp_path)!r})
rng = np.random.default_rng(0)
def block(m, p0):
    k = rng.normal(size=(3, m, 8)).astype(np.float32).view(np.uint8)
    return np.tile(np.arange(p0, p0 + m, dtype=np.int32), (3, 1)), k, rng.integers(0, 256, (3, m, 32), dtype=np.uint8)
st.add(*block(10, 0))
before = (st.pos.copy(), st.sums.copy(), st.counts.copy(), st.means_t.copy(), st.k[1].copy(), st.v[1].copy())
size = st.file.seek(0, 2)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 3 * 6 * 32 + 50, resource.RLIM_INFINITY))   # K fits, V does not
try:
    st.add(*block(6, 10))
except OSError as e:
    print("refused", e.errno)
after = (st.pos, st.sums, st.counts, st.means_t, st.k[1], st.v[1])
print("same", all(np.array_equal(a, b) for a, b in zip(before, after)) and st.k.n == st.v.n == 10)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused 27" in r.stdout and "same True" in r.stdout, r.stdout + r.stderr


def test_a_prompt_that_ends_in_its_own_eviction_keeps_the_logits_it_ended_with(model):
    """Without a lookahead draft, a prompt's last window still scores when its final eviction has
    compacted the last token, and the turn's recall runs: the last token cannot (and need not) be
    evaluated again - its logits saw the whole cache. They stay, and decoding goes on."""
    import llama_cpp
    toks = prompt(200, 9)
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": 4}, lookahead=0, **SETTINGS)
    plain = llama_cpp.Llama(model, n_ctx=256, verbose=False, seed=0, n_threads=2, n_threads_batch=2)
    plain.eval(toks)
    llm.eval(toks)
    assert llm.kv_report()["evictions"] == 1 and llm.kv_report()["recall"]["recalls"] >= 1
    assert np.array_equal(logits(llm), logits(plain))
    decode(llm, 6)
    assert llm.n_tokens == 206


def reference_digests(si, pages, keys, sign, sums, counts, means_t):
    """llama_entrokv_digest_update in plain Python: per (slot, page), its tokens' keys summed in the order
    given as float32, added to (or taken from) the page's sum; an emptied page's sum exactly 0; the mean
    divided in float64 and rounded to float32."""
    sums, counts, means_t = sums.copy(), counts.copy(), means_t.copy()
    groups = {}
    for i, u in enumerate(zip(si.tolist(), pages.tolist())):
        groups.setdefault(u, []).append(i)
    for (s, p), idx in groups.items():
        counts[s, p] += sign * len(idx)
        if counts[s, p] == 0:
            sums[s, p] = 0.0
        else:
            acc = keys[idx[0]].copy()
            for i in idx[1:]:
                acc += keys[i]
            sums[s, p] += np.float32(sign) * acc
        means_t[s, :, p] = (sums[s, p].astype(np.float64) / max(int(counts[s, p]), 1)).astype(np.float32)
    return sums, counts, means_t


def test_digest_update_matches_plain_sums_in_order_and_refuses_without_writing():
    """The store's digests in C (llama_entrokv_digest_update): tokens coming in and leaving, several per
    page and pages emptied, give bit for bit the sums, counts and means of the plain reference; pages not
    touched stay as they were; a slot or page out of range, or a count below 0, changes nothing."""
    from entrokv_edge.bindings import EntroKVError, digest_update
    rng = np.random.default_rng(3)
    S, npg, d = 5, 40, 12
    sums, counts = np.zeros((S, npg, d), np.float32), np.zeros((S, npg), np.int64)
    means_t = np.zeros((S, d, npg), np.float32)
    held = []                                                  # (slot, page, key) of the tokens in the digests
    for trial in range(40):
        if trial % 2 == 0 or not held:                         # tokens come in, up to 70 per page
            m = int(rng.integers(1, 300))
            si, pages = rng.integers(0, S, m), rng.integers(0, 3 if trial % 4 == 0 else npg, m)
            keys = rng.normal(size=(m, d)).astype(np.float32) * 10 ** rng.uniform(-3, 3, (m, 1)).astype(np.float32)
            sign = 1
            held += list(zip(si.tolist(), pages.tolist(), keys))
        else:                                                  # some leave, whole pages among them
            take = rng.permutation(len(held))[: int(rng.integers(1, len(held) + 1))]
            if trial % 3 == 0:
                s0, p0 = held[take[0]][:2]
                take = np.union1d(take, [i for i, h in enumerate(held) if h[:2] == (s0, p0)])
            si = np.array([held[i][0] for i in take])
            pages = np.array([held[i][1] for i in take])
            keys = np.stack([held[i][2] for i in take])
            sign = -1
            held = [h for i, h in enumerate(held) if i not in set(take.tolist())]
        want = reference_digests(si, pages, keys, sign, sums, counts, means_t)
        digest_update(si, pages, keys, sign, sums, counts, means_t)
        for got, w in zip((sums, counts, means_t), want):
            assert np.array_equal(got.view(np.uint8), w.view(np.uint8)), trial
    live = counts > 0
    assert live.any() and (counts == np.bincount([h[0] * npg + h[1] for h in held], minlength=S * npg).reshape(S, npg)).all()
    assert not sums[~live].any() and not means_t.transpose(0, 2, 1)[~live].any()      # emptied pages: exactly 0
    before = (sums.copy(), counts.copy(), means_t.copy())
    key = np.ones((2, d), np.float32)
    empty = np.argwhere(~live)[0]
    for si, pages, sign in (([0, S], [0, 0], 1), ([0, 0], [0, npg], 1), ([0, -1], [0, 0], 1),
                            ([empty[0]] * 2, [empty[1]] * 2, -1)):
        with pytest.raises((EntroKVError, ValueError)):
            digest_update(np.array(si), np.array(pages), key, sign, sums, counts, means_t)
        for got, w in zip((sums, counts, means_t), before):
            assert np.array_equal(got, w)
    with pytest.raises(ValueError, match="C-contiguous"):
        digest_update(np.array([0]), np.array([0]), key[:1], 1, sums, counts.astype(np.int32), means_t)


@pytest.mark.parametrize("lookahead", [0, 8])
def test_a_prompt_read_in_pieces_ends_with_its_questions_recall(model, lookahead):
    """A prompt longer than the cache, read in pieces: its evictions fill the store, and its last window
    (the question) drives a turn's recall after the final eviction, with or without the lookahead draft
    that eviction is scored with (the draft's scores keep the window's queries). Every position stays
    once, in the cache or in the store. (Without reselect: with it, the final eviction itself chooses among
    the stored tokens, and no turn's recall follows; tests/test_reselect.py.)"""
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "turn_draft": 0}, lookahead=lookahead, guide_draft=0,
                          reselect=False, **SETTINGS)
    toks = prompt(700, 11)
    llm.eval(toks)
    rep = llm.kv_report()
    assert rep["evictions"] >= 3 and rep["recall"]["recalls"] == 1 and rep["recall"]["recalled_tokens"] > 0
    assert (rep["drafted_tokens"] > 0) == (lookahead > 0)
    assert_each_position_once(llm, 700)
    decode(llm, 6)
    assert llm.n_tokens == 706


@pytest.mark.parametrize("turn_len,draft", [(24, 0), (10, 0), (24, 6)])
def test_a_reselected_turn_chooses_among_cache_and_store_and_answers_from_what_came_back(model, turn_len, draft):
    """turn="reselect": a later turn's last token is taken out, an eviction chooses among the cache and the whole
    store by the turn's queries (and a draft's), and the last token is evaluated again: every position once, in
    the cache or the store; the budget held; the last logits those of the turn's last token on the cache as
    chosen; a stored token brought back where the turn attends to it."""
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={"turn": "reselect", "decode": False, "turn_draft": draft},
                          **SETTINGS)
    llm.eval(prompt(200, 1))
    assert llm.stats.evictions == 1 and llm.recall.store.n_tokens == 200 - 64
    decode(llm, 5)
    n0, ev0 = llm.n_tokens, llm.stats.evictions
    turn = prompt(turn_len, 7)
    llm.eval(turn)
    assert llm.stats.evictions == ev0 + 1 and llm.stats.recalls == 1 and llm.stats.recalled > 0
    assert (llm.stats.recall_drafted > 0) == bool(draft)
    assert llm.n_tokens == n0 + turn_len
    assert_each_position_once(llm, n0 + turn_len)
    assert ek.geometry(llm).n_compacted == llm.last_eviction.metrics["kept_tokens"] <= 64     # (a partial last page)
    assert last_logits_are_fresh(llm, turn[-1])


def test_a_single_prompt_reads_as_without_a_store_in_reselect_mode(model):
    """turn="reselect" touches later turns only: a prompt (read in pieces or not) and its answer are what they are
    without recall, token for token."""
    for n in (200, 700):
        plain = ek.EntroKVLlama(model, n_ctx=256, recall=False, **SETTINGS)
        kept = ek.EntroKVLlama(model, n_ctx=256, recall={"turn": "reselect", "decode": False}, **SETTINGS)
        toks = prompt(n, 3)
        plain.eval(toks)
        kept.eval(toks)
        for _ in range(20):
            a, b = int(np.argmax(logits(plain))), int(np.argmax(logits(kept)))
            assert a == b and np.array_equal(logits(plain), logits(kept)), n
            plain.eval([a])
            kept.eval([b])
        assert kept.stats.recalls == 0 and kept.recall.store.n_tokens > 0


def test_the_store_keeps_within_its_cap_and_says_what_it_dropped(model):
    llm = ek.EntroKVLlama(model, n_ctx=256, recall={**RECALL, "store_mib": 0.01}, **SETTINGS)    # 10 KiB: nothing fits
    llm.eval(prompt(700, 2))
    rep = llm.kv_report()["recall"]
    # (read in pieces: every eviction's tokens dropped; the store holds none, with recall's own reselect at the end
    # choosing among the cache alone)
    assert rep["store_tokens_per_group"] == 0 and rep["dropped_tokens_per_group"] >= 700 - 256
    assert rep["store_bytes"] == 0 and rep["store_mib"] == 0.01
    big = ek.EntroKVLlama(model, n_ctx=256, recall=RECALL, **SETTINGS)
    big.eval(prompt(700, 2))
    assert big.kv_report()["recall"]["dropped_tokens_per_group"] == 0
    assert big.recall.store.n_tokens + ek.geometry(big).n_used == 700           # every token kept, in one or the other
    with pytest.raises(ValueError, match="store_mib"):
        ek.EntroKVLlama(model, n_ctx=256, recall={"store_mib": -1}, **SETTINGS)
    with pytest.raises(TypeError, match="turns"):
        ek.EntroKVLlama(model, n_ctx=256, recall="turn", **SETTINGS)


def test_turns_recall_answers_a_single_prompt_as_without_it_and_recalls_at_a_later_turn(model):
    """recall="turns": a store in a temporary file; a prompt (read in pieces or not) and its answer are what
    they are without recall (the default), token for token (no recall after the first prompt's own eviction,
    none while decoding); a later turn's queries then bring stored tokens back, every position still once, the
    budget held, the last logits those of the turn's last token on the cache as recalled."""
    import tempfile
    for n in (200, 700):
        plain = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
        llm = ek.EntroKVLlama(model, n_ctx=256, recall="turns", **SETTINGS)
        toks = prompt(n, 5)
        plain.eval(toks)
        llm.eval(toks)
        for _ in range(12):
            a, b = int(np.argmax(logits(plain))), int(np.argmax(logits(llm)))
            assert a == b and np.array_equal(logits(plain), logits(llm)), n
            plain.eval([a])
            llm.eval([b])
        rep = llm.kv_report()["recall"]
        assert plain.kv_report()["recall"] == {"on": False}
        assert rep["on"] and rep["where"] == f"file in {tempfile.gettempdir()}" and rep["recalls"] == 0
        assert rep["store_tokens_per_group"] > 0 and rep["store_bytes"] > 0
        assert rep["store_bytes_in_memory"] < rep["store_bytes"]            # the rows are in the file
        n0 = llm.n_tokens
        turn = prompt(10, 9)                                                 # a later turn, after the evictions
        llm.eval(turn)
        assert llm.stats.recalls == 1 and llm.stats.recalled > 0 and llm.stats.recall_drafted == 0
        assert_each_position_once(llm, n0 + 10)
        assert ek.geometry(llm).n_compacted <= 64 + 8                        # within the budget (a partial page)
        assert last_logits_are_fresh(llm, turn[-1])
        for x in (plain, llm):
            x.close()
