"""lookahead: the draft's attention against an independent reference (the drafted tokens
evaluated again as one observed ubatch on a twin context), the cache left as it was, and the
controller and the runtime evicting with the mixed scores."""
import numpy as np
import pytest

import entrokv_edge as ek
from entrokv_edge.controller import select
from entrokv_edge.bindings.observe import head_slots
from entrokv_edge.runtime.drafts import lookahead_scores
from entrokv_edge.controller.pages import pages_to_positions
from helpers import logits, make_llm, state_blob
from llama_cpp import llama_cpp as C
from test_compaction import prompt

W = 16


def observed(llm, toks, w=W):
    """Evaluate toks, the last w as one observed ubatch; the window's scores."""
    toks = [int(t) for t in toks]
    llm.eval(toks[:-w])
    with ek.Observation(llm, w) as obs:
        llm.eval(toks[-w:])
    return obs.last


def greedy_draft(llm, k):
    """Up to k tokens decoded greedily on llm, stopping before an end-of-generation token."""
    vocab = C.llama_model_get_vocab(llm.model)
    draft, lg = [], logits(llm)
    while len(draft) < k and not C.llama_vocab_is_eog(vocab, int(np.argmax(lg))):
        draft.append(int(np.argmax(lg)))
        llm.eval([draft[-1]])
        lg = logits(llm)
    return draft


def reference(path, toks, k, **kw):
    """Window scores, the greedy draft (stopping before an end-of-generation token, at most
    k tokens) and the draft's summed attention on the prompt's cells, from one batched
    evaluation of the drafted tokens on a fresh context."""
    a = make_llm(path, **kw)
    win = observed(a, toks)
    draft = greedy_draft(a, k)
    a.close()
    b = make_llm(path, **kw)
    observed(b, toks)
    with ek.Observation(b, len(draft)) as obs:
        b.eval(draft)
    n = len(toks)
    summed = obs.last.scores[:, :, :n] * len(draft)     # mean over the drafted queries, times their count
    b.close()
    return win, draft, summed


@pytest.mark.parametrize("model,fa", [("llama-r3", False), ("qwen2-r2", True)])
def test_lookahead_scores_equal_the_batched_draft_and_leave_the_cache(synth_models, model, fa):
    path = synth_models[model]
    toks = prompt(11)
    kw = dict(type_k="f32", flash_attn=fa)
    win_ref, draft, summed = reference(path, toks, 6, **kw)
    assert len(draft) >= 3                                   # a real draft, not the empty case
    llm = make_llm(path, **kw)
    win = observed(llm, toks)
    np.testing.assert_array_equal(win.scores, win_ref.scores)
    blob, lg, n = state_blob(llm), logits(llm), llm.n_tokens
    mixed = lookahead_scores(llm, win, 6, llm.eval)
    # the cache, the token count and the last logits as before the draft
    assert state_blob(llm) == blob and np.array_equal(logits(llm), lg) and llm.n_tokens == n
    assert ek.geometry(llm).n_used == n
    want = (W * win.scores + summed) / (W + len(draft))
    assert mixed.scores.shape == win.scores.shape
    np.testing.assert_allclose(mixed.scores, want, rtol=1e-4, atol=1e-7)
    assert np.abs(mixed.scores - win.scores).max() > 1e-3   # the draft moved the scores
    assert mixed.pos_last == win.pos_last and np.array_equal(mixed.true_pos, win.true_pos)
    # a share for the draft (lookahead_share): (1 - x) x the window's + x x the drafted tokens' mean
    for x in (0.7, 1.0):
        shared = lookahead_scores(llm, win, 6, llm.eval, share=x)
        np.testing.assert_allclose(shared.scores, (1 - x) * win.scores + x * summed / len(draft), rtol=1e-4, atol=1e-7)
        assert state_blob(llm) == blob and llm.n_tokens == n
    # k = 0: the window's scores, nothing decoded
    assert lookahead_scores(llm, win, 0, llm.eval) is win and state_blob(llm) == blob


def test_the_draft_stops_where_the_cache_is_full(synth_models):
    """Two free cells: two tokens drafted, whatever k asks."""
    path = synth_models["llama-r3"]
    kv = make_llm(path, n_ctx=256, type_k="f32")
    n = ek.geometry(kv).kv_size - 2
    kv.close()
    toks = np.random.default_rng(3).integers(3, 300, n)
    _, draft, summed = reference(path, toks, 2, type_k="f32")
    assert len(draft) == 2
    llm = make_llm(path, type_k="f32")
    win = observed(llm, toks)
    mixed = lookahead_scores(llm, win, 8, llm.eval)
    np.testing.assert_allclose(mixed.scores, (W * win.scores + summed) / (W + 2), rtol=1e-4, atol=1e-7)
    assert ek.geometry(llm).n_used == n


def test_lookahead_refuses_scores_of_another_cache_state(synth_models):
    llm = make_llm(synth_models["llama-r3"], type_k="f32")
    win = observed(llm, prompt(12))
    llm.eval([5, 6])                                 # tokens after the observed window
    blob = state_blob(llm)
    with pytest.raises(ValueError, match="last tokens"):
        lookahead_scores(llm, win, 4, llm.eval)
    with pytest.raises(ValueError, match="lookahead must be an integer"):
        lookahead_scores(llm, win, -1, llm.eval)
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match=r"lookahead_share must be a number in \[0, 1\]"):
            lookahead_scores(llm, win, 4, llm.eval, share=bad)
    assert state_blob(llm) == blob


def test_controller_and_runtime_evict_with_the_mixed_scores(synth_models):
    """EvictionController.prefill and EntroKVLlama (after a prompt) keep what select() keeps on the
    window's scores mixed with the draft's (with the configured share); the runtime then answers
    from the prompt's logits."""
    path = synth_models["llama-r3"]
    toks = prompt(13)
    cfg = ek.EvictionConfig(budget=24, page_size=4, window=W, sinks=4, lookahead=5, lookahead_share=0.6)
    twin = make_llm(path, type_k="f32")
    mixed = lookahead_scores(twin, observed(twin, toks), 5, twin.eval, share=cfg.lookahead_share)
    n, r = len(toks), 3                                      # llama-r3: 6 query heads on 2 KV heads
    sel = select(mixed.scores[:, :, :n], r, cfg, n)
    want = pages_to_positions(sel.pages, cfg.page_size, n)
    plain = select(observed(make_llm(path, type_k="f32"), toks).scores[:, :, :n], r, cfg, n)
    assert not np.array_equal(plain.pages, sel.pages)        # lookahead changed what is kept

    llm = make_llm(path, type_k="f32")
    res = ek.EvictionController(cfg).prefill(llm, toks.tolist())
    np.testing.assert_array_equal(res.positions, want)
    assert llm.n_tokens == n

    rt = ek.EntroKVLlama(str(path), n_ctx=256, n_batch=256, n_ubatch=256, type_k=0, type_v=0, verbose=False,
                         seed=0, n_threads=2, eviction=cfg)
    rt.eval(toks.tolist())
    assert rt.stats.evictions == 1 and rt.n_tokens == n
    np.testing.assert_array_equal(rt.last_eviction.positions, want)
    np.testing.assert_array_equal(logits(rt), logits(twin))   # the prompt's logits, restored after the draft


def test_an_observation_without_a_kept_copy_still_calls_its_handler(synth_models):
    llm = make_llm(synth_models["llama-r3"], type_k="f32")
    llm.eval([int(t) for t in prompt(14)[:-W]])
    got = []
    with ek.Observation(llm, W, handler=lambda v: got.append(v.scores.sum()), keep_last=False) as obs:
        llm.eval([int(t) for t in prompt(14)[-W:]])
    assert obs.last is None and obs.count == 1 and len(got) == 1 and got[0] > 0


def _holed(path, **kw):
    """A context whose window was observed, then 11 of its tokens (positions 10-20) removed:
    the draft's tokens land in those cells, which the window saw holding other tokens."""
    llm = make_llm(path, **kw)
    win = observed(llm, prompt(15, 72))
    assert C.llama_memory_seq_rm(llm._ctx.memory, 0, 10, 21)
    return llm, win


def test_only_the_cells_that_hold_what_the_window_saw_count(synth_models):
    """The draft's attention counts on the cells that still hold the tokens the window saw;
    cells reused by the drafted tokens count for nothing (a batched reference says so too)."""
    path, kw = synth_models["llama-r3"], dict(type_k="f32")
    draft = greedy_draft(_holed(path, **kw)[0], 5)           # the reference draft
    assert len(draft) >= 3
    b, win_b = _holed(path, **kw)
    with ek.Observation(b, len(draft)) as obs:
        b.eval(draft)
    L, H, n_w = win_b.scores.shape
    slot_of = head_slots(L, H, win_b.n_head_kv)
    ok = (win_b.true_pos >= 0) & (obs.last.true_pos[:, :n_w] == win_b.true_pos)
    assert not ok[:, 10:10 + len(draft)].any() and ok[:, :10].all()      # the drafted tokens sit in the hole
    summed = np.where(ok[slot_of], obs.last.scores[:, :, :n_w] * len(draft), 0.0)
    llm, win = _holed(path, **kw)
    blob = state_blob(llm)
    mixed = lookahead_scores(llm, win, 5, llm.eval)
    np.testing.assert_allclose(mixed.scores, (W * win.scores + summed) / (W + len(draft)), rtol=1e-4, atol=1e-7)
    assert state_blob(llm) == blob
    np.testing.assert_array_equal(mixed.scores[:, :, 10:21], W * win.scores[:, :, 10:21] / (W + len(draft)))


def test_a_failing_draft_leaves_the_cache_as_it_was(synth_models):
    llm = make_llm(synth_models["llama-r3"], type_k="f32")
    win = observed(llm, prompt(17))
    blob, lg, n = state_blob(llm), logits(llm), llm.n_tokens
    calls = []

    def flaky(toks):
        calls.append(toks)
        if len(calls) == 3:
            raise KeyboardInterrupt          # the user stops it mid-draft
        llm.eval(toks)

    with pytest.raises(KeyboardInterrupt):
        lookahead_scores(llm, win, 8, flaky)
    assert state_blob(llm) == blob and np.array_equal(logits(llm), lg) and llm.n_tokens == n


def test_the_draft_fits_llama_cpp_pythons_token_buffer(synth_models):
    """n_ctx 300: llama.cpp pads the cache to 512 cells, llama-cpp-python's token buffer
    holds 300; a 297-token prompt leaves room for 3 drafted tokens, not 24."""
    llm = make_llm(synth_models["llama-r3"], n_ctx=300, type_k="f32")
    assert ek.geometry(llm).kv_size > 300 == len(llm.input_ids)
    win = observed(llm, np.random.default_rng(5).integers(3, 300, 297))
    blob, stats = state_blob(llm), {}
    mixed = lookahead_scores(llm, win, 24, llm.eval, stats)
    assert 1 <= stats["drafted"] <= 3 and mixed is not win and state_blob(llm) == blob


@pytest.mark.parametrize("fa", [False, True])
def test_gemma3_draft_leaves_both_caches_as_they_were(gemma3, fa):
    """Gemma 3 (sliding-window and global layers, two caches): the draft is removed from both."""
    llm = make_llm(gemma3, n_ctx=512, flash_attn=fa)
    toks = llm.tokenize(b"The spare key for Ines's bicycle is in drawer 927. " * 12 +
                        b"In which drawer is the spare key for Ines's bicycle?")
    win = observed(llm, toks)
    blob, lg, stats = state_blob(llm), logits(llm), {}
    mixed = lookahead_scores(llm, win, 6, llm.eval, stats)
    assert stats["drafted"] >= 1 and state_blob(llm) == blob and np.array_equal(logits(llm), lg)
    assert np.abs(mixed.scores - win.scores).max() > 1e-4
