"""The in-graph observation-window scores against an independent numpy reference."""
import numpy as np
import pytest

import entrokv_edge as ek
from entrokv_edge.bindings.observe import Observation
from helpers import feed, make_llm
from reference import CapturingContext, reference_scores

W = 16


def check_against_reference(path, toks, flash_attn, type_k, head_dim):
    cc = CapturingContext(path, flash_attn=flash_attn, type_k=type_k)
    raw = []
    try:
        with Observation(cc.ctx, W, handler=lambda view: raw.append(view.scores.copy())) as obs:
            cc.decode(toks)
        s = obs.last
        T = len(toks)
        assert obs.count == 1 and s.window == W and s.n_tokens == T and s.pos_last == T - 1
        g = ek.geometry(cc.ctx)
        assert list(s.layer_ids) == [l.il for l in g.layers]
        assert s.scores.shape[-1] == T and (s.true_pos == np.arange(T)).all()   # the copy keeps the used cells
        assert raw[0].shape[-1] >= T and raw[0].dtype == np.float32
        worst = 0.0
        for li, il in enumerate(s.layer_ids):
            q, k = cc.captured[f"Qcur-{il}"], cc.captured[f"Kcur-{il}"]
            if type_k == 1:       # an F16 cache holds K in F16, and ggml's F16 matmul rounds Q to F16 too
                q, k = q.astype(np.float16), k.astype(np.float16)
            ref = reference_scores(q, k, W, 1 / np.sqrt(head_dim))
            worst = max(worst, np.abs(s.scores[li, :, :T] - ref).max())
            assert np.abs(raw[0][li, :, T:]).max() < 1e-7            # empty cells get nothing
            # the window's queries, scaled as attention scales them: q . k is the logit
            qs = cc.captured[f"Qcur-{il}"][T - W:] / np.sqrt(head_dim)
            assert s.queries.shape == (len(s.layer_ids), W) + qs.shape[1:]
            assert np.abs(s.queries[li] - qs).max() <= 1e-6 * max(1.0, np.abs(qs).max())
        assert worst < 1e-4, worst
        return worst
    finally:
        cc.close()


@pytest.mark.parametrize("fa", [False, True], ids=["fa-off", "fa-on"])
def test_an_observation_of_the_queries_only(synth_models, fa):
    """llama_entrokv_set_query_observer: the same queries as the captured Qcur (scaled), no
    attention and no cells; the C eviction refuses to run on such an observation."""
    from entrokv_edge.bindings.native import c_api, context_pointer
    cc = CapturingContext(synth_models["llama-r3"], flash_attn=fa, type_k=0)
    toks = np.random.default_rng(5).integers(3, 300, 40)
    try:
        with Observation(cc.ctx, W, queries_only=True) as obs:
            cc.decode(toks)
        s, T = obs.last, len(toks)
        assert obs.count == 1 and s.window == W and s.pos_last == T - 1
        assert s.scores.shape == (len(s.layer_ids), s.queries.shape[2], 0) and s.true_pos.shape[1] == 0
        for li, il in enumerate(s.layer_ids):
            qs = cc.captured[f"Qcur-{il}"][T - W:] / np.sqrt(32)
            assert np.abs(s.queries[li] - qs).max() <= 1e-6 * max(1.0, np.abs(qs).max())
        ffi, lib = c_api()
        prm = ffi.new("struct llama_entrokv_params *", lib.llama_entrokv_default_params())
        assert lib.llama_entrokv_evict(context_pointer(cc.ctx), 0, prm) == lib.LLAMA_ENTROKV_ERR_INVALID_ARG
        assert b"queries only" in ffi.string(lib.llama_entrokv_last_error())
    finally:
        cc.close()


def check_decode_observer(path, chunks, flash_attn, type_k, head_dim, tol, warm=()):
    """llama_entrokv_set_decode_observer over ubatches ``chunks`` (token lists) decoded in turn: each ubatch's last
    query, and its attention as the decode computed it (rows) against numpy's over every key so far (an F16 cache
    rounds K and, in ggml's matmul, Q to F16: the reference does too); with flash attention no rows. ``warm``:
    ubatches decoded first under a window-1 query observer (graphs of as many nodes, no rows)."""
    cc = CapturingContext(path, flash_attn=flash_attn, type_k=type_k)
    keys: dict[int, np.ndarray] = {}
    views = []

    def add_keys(layer_ids):
        for il in layer_ids:
            kc = cc.captured[f"Kcur-{il}"]
            keys[il] = np.concatenate([keys.get(il, np.zeros((0,) + kc.shape[1:], np.float32)), kc])
    try:
        P = 0
        if warm:
            with Observation(cc.ctx, 1, keep_last=True, queries_only=True) as warm_obs:
                for toks in warm:
                    cc.decode(toks)
                    P += len(toks)
                    add_keys(warm_obs.last.layer_ids)
        with Observation(cc.ctx, 1, handler=lambda v: views.append(v.copy()), keep_last=False, queries_only=True,
                         rows=True) as obs:
            for toks in chunks:
                cc.decode(toks)
                P += len(toks)
                v = views[-1]
                assert obs.count == len(views) and v.pos_last == P - 1 and v.queries.shape[1] == 1
                if flash_attn:
                    assert v.rows is None
                    continue
                assert v.rows.shape[:2] == (len(v.layer_ids), v.queries.shape[2]) and v.rows.shape[2] >= P
                add_keys(v.layer_ids)
                for li, il in enumerate(v.layer_ids):
                    q, k = cc.captured[f"Qcur-{il}"][-1], keys[il]                  # [H, d], [P, G, d]
                    if type_k == 1:
                        q, k = q.astype(np.float16), k.astype(np.float16)
                    k = np.repeat(k, q.shape[0] // k.shape[1], axis=1).astype(np.float64)    # [P, H, d]
                    logit = np.einsum("hd,phd->hp", q.astype(np.float64), k) / np.sqrt(head_dim)
                    ref = np.exp(logit - logit.max(-1, keepdims=True))
                    ref /= ref.sum(-1, keepdims=True)
                    assert np.abs(v.rows[li, :, :P] - ref).max() < tol, (len(toks), il)
                    assert np.all(v.rows[li, :, P:] == 0.0)                     # empty cells get nothing
                    # the queries are the same token's, scaled as attention scales them
                    qs = cc.captured[f"Qcur-{il}"][-1] / np.sqrt(head_dim)
                    assert np.abs(v.queries[li, 0] - qs).max() <= 1e-6 * max(1.0, np.abs(qs).max())
    finally:
        cc.close()


@pytest.mark.parametrize("fa", [False, True], ids=["fa-off", "fa-on"])
def test_the_decode_observer_hands_over_the_decodes_own_attention(synth_models, fa):
    """Through ubatches of several tokens and of one in any order: ggml reuses a graph's allocation plan for
    graphs of the same shape, so an output that only some graphs flagged would be overwritten."""
    rng = np.random.default_rng(8)
    chunks = [rng.integers(3, 300, n) for n in (40, 1, 5, 1, 1, 12, 1)]
    check_decode_observer(synth_models["llama-r3"], chunks, fa, type_k=0, head_dim=32, tol=1e-5)
    # one-token graphs of the query observer first: the decode observer's one-token graphs have as many nodes (their
    # softmax is flagged as an output, no node added); its rows must still be the softmax's
    warm = [rng.integers(3, 300, n) for n in (30, 1, 1, 1)]
    check_decode_observer(synth_models["llama-r3"], [rng.integers(3, 300, 1) for _ in range(4)], fa, type_k=0,
                          head_dim=32, tol=1e-5, warm=warm)
    with pytest.raises(ValueError, match="decode observer"):
        Observation(None, 2, queries_only=True, rows=True)


@pytest.mark.parametrize("model", ["smollm2", "qwen25"])
def test_the_decode_observer_on_real_models(request, model):
    """SmolLM2 (r = 3) and Qwen2.5 (r = 7, biased Q/K projections), F16 caches: a prompt, then decoded tokens."""
    import llama_cpp
    path = request.getfixturevalue(model)
    m = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    toks = m.tokenize(b"In the quiet harbour town, the keeper of the lighthouse kept a ledger of every ship. "
                      b"One night he wrote the code 4417 beside the name of a schooner that never came back.")
    chunks = [toks[:-3], toks[-3:-2], toks[-2:-1], toks[-1:]]
    check_decode_observer(path, chunks, False, type_k=1, head_dim=64, tol=1e-4)


@pytest.mark.parametrize("fa", [False, True], ids=["fa-off", "fa-on"])
@pytest.mark.parametrize("model", ["llama-r1", "llama-r2", "llama-r3", "llama-r6", "qwen2-r3"])
def test_scores_match_reference_on_synthetic_models(synth_models, model, fa):
    toks = np.random.default_rng(3).integers(3, 300, 80)
    check_against_reference(synth_models[model], toks, fa, type_k=0, head_dim=32)


@pytest.mark.parametrize("model, fa", [("smollm2", False), ("smollm2", True), ("qwen25", False), ("qwen25", True)],
                         ids=["smollm2-fa-off", "smollm2-fa-on", "qwen25-fa-off", "qwen25-fa-on"])
def test_scores_match_reference_on_real_models(request, model, fa):
    """SmolLM2 (r = 3) and Qwen2.5 (r = 7, biased Q/K projections) against numpy."""
    import llama_cpp
    path = request.getfixturevalue(model)
    m = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    toks = m.tokenize(b"In the quiet harbour town, the keeper of the lighthouse kept a ledger of every ship. "
                      b"One night he wrote the code 4417 beside the name of a schooner that never came back.")
    check_against_reference(path, toks, fa, type_k=1, head_dim=64)


def test_observation_through_llama_and_after_compaction(synth_models):
    llm = make_llm(synth_models["llama-r3"])
    toks = np.random.default_rng(4).integers(3, 300, 64)
    feed(llm, toks[:-W])
    with Observation(llm, W) as obs:
        feed(llm, toks[-W:])
        assert obs.count == 1
        feed(llm, [5])                      # a 1-token ubatch is shorter than the window: not observed
        assert obs.count == 1
    g = ek.geometry(llm)
    keep = np.sort(np.stack([np.random.default_rng(s).choice(65, 20, replace=False) for s in range(g.n_slots)]), 1)
    ek.compact(llm, keep.astype(np.int32))
    with Observation(llm, W) as obs:
        feed(llm, np.random.default_rng(5).integers(3, 300, W))
    s = obs.last
    assert (s.true_pos[:, :20] == keep).all()                     # columns map to true positions per slot
    assert (s.true_pos[:, 20:20 + W] == np.arange(65, 65 + W)).all()
    np.testing.assert_allclose(s.scores.sum(-1), 1.0, atol=1e-5)
    feed(llm, [7, 8])                        # observation off: decoding goes on normally
    assert ek.geometry(llm).pos_max == 65 + W + 1


def test_an_observation_and_its_scores_are_freed_when_dropped_without_the_garbage_collector(synth_models):
    """Nothing but its user holds an observation: its scores (MiBs on a real model) go when it is
    dropped, not when the cyclic garbage collector next runs (a long prompt makes two per piece)."""
    import gc
    import weakref
    llm = make_llm(synth_models["llama-r3"])
    gc.disable()
    try:
        with Observation(llm, W) as obs:
            feed(llm, np.random.default_rng(6).integers(3, 300, 2 * W))
        assert obs.count == 1
        gone_obs, gone_last = weakref.ref(obs), weakref.finalize(obs.last.scores, lambda: None)
        del obs
        assert gone_obs() is None and not gone_last.alive
    finally:
        gc.enable()
    with Observation(llm, W) as again:      # observing still works after one was freed mid-run
        feed(llm, np.random.default_rng(7).integers(3, 300, W))
    assert again.count == 1


def test_bad_windows_are_refused(synth_models):
    llm = make_llm(synth_models["llama-r2"], n_ctx=64)
    with pytest.raises(ValueError):
        Observation(llm, 0)
    with pytest.raises(ek.EntroKVError, match="n_ubatch"):
        Observation(llm, 65).start()


@pytest.mark.parametrize("fa", [False, True], ids=["fa-off", "fa-on"])
def test_observing_does_not_change_the_model_and_toggles_cleanly(synth_models, fa):
    path = synth_models["qwen2-r2"]
    a, b = make_llm(path, flash_attn=fa), make_llm(path, flash_attn=fa)
    toks = np.random.default_rng(6).integers(3, 300, 90)
    feed(a, toks[:40]), feed(b, toks[:40])
    for rnd in range(3):                     # on, off, on: graphs rebuilt and re-reserved each time
        chunk = toks[40 + rnd * 16: 56 + rnd * 16]
        if rnd != 1:
            with Observation(a, W) as obs:
                la = feed(a, chunk)
            assert obs.count == 1 and obs.last.pos_last == 55 + rnd * 16
        else:
            la = feed(a, chunk)
        assert np.array_equal(la, feed(b, chunk))
    for t in (3, 4, 5):                      # and single-token decoding after it
        assert np.array_equal(feed(a, [t]), feed(b, [t]))
