"""Compaction on the real GGUF models we ship: SmolLM2-135M (llama, r = 3), Gemma 3 270M
(iswa: only its full-attention cache is compacted) and Qwen2.5-Coder-0.5B (qwen2, r = 7)."""
import ctypes

import numpy as np

import entrokv_edge as ek
from helpers import feed, greedy, load_blob, logits, make_llm, oracle_blob, parse_cache, random_keep, state_blob
from llama_cpp import llama_cpp as C

TEXT = ("The old lighthouse keeper wrote the secret code 7391 in his journal before the storm. "
        "Ships passed the rocky island every night, and he counted them one by one while the "
        "lamp turned slowly above the sea. In the morning the fishermen came to ask for news.")


def tokens(llm):
    return llm.tokenize(TEXT.encode(), add_bos=True)


def check_same_keep_against_seq_rm(path, n_ctx, geometry, stride, n_probe):
    """One keep on every slot (sinks, every stride-th token, the last 8) against llama.cpp's own seq_rm
    of the other positions, on F32 caches: the serialized sequences hold the same K and V bytes in the
    same order, and a context loaded with what seq_rm left decodes exactly like the compacted one.

    The decode is compared through a loaded copy because seq_rm leaves holes and the next tokens land
    in them: on AVX2 the attention's sums then run in another order, and through 30 layers of Q4
    weights that moves the logits by up to ~0.8 (measured) - as much as removing one wrong token."""
    a, b = make_llm(path, n_ctx=n_ctx, type_k="f32"), make_llm(path, n_ctx=n_ctx, type_k="f32")
    toks = tokens(a)
    n = len(toks)
    feed(a, toks), feed(b, toks)
    g = ek.geometry(a)
    assert (g.n_layers, g.n_slots, g.layers[0].n_head_kv) == geometry
    keep = np.unique(np.concatenate([np.arange(4), np.arange(9, n, stride), np.arange(n - 8, n)]))
    ek.compact(a, np.tile(keep, (g.n_slots, 1)).astype(np.int32))
    for p in sorted(set(range(n)) - set(keep.tolist())):
        assert b._ctx.kv_cache_seq_rm(0, p, p + 1)
    removed = state_blob(b)
    mine, theirs = parse_cache(state_blob(a)), parse_cache(removed)
    assert theirs.pos.tolist() == keep.tolist()  # compaction renumbers positions, in the same order
    assert mine.pos.tolist() == list(range(n - len(keep), n))
    for x, y in zip(mine.k + mine.v, theirs.k + theirs.v):
        assert x[:-1] == y[:-1] and np.array_equal(x[-1], y[-1])
    c = make_llm(path, n_ctx=n_ctx, type_k="f32")
    load_blob(c, removed, toks)
    for t in tokens(a)[1:1 + n_probe]:
        assert np.abs(feed(a, [t]) - feed(c, [t])).max() <= 1e-5


def check_per_head_keep_against_state_rewrite(path, n_ctx, seed, first, steps):
    """A random keep per (layer, KV head) equals the state rewritten in Python, byte for byte, and a
    second context loaded with that state decodes the same tokens and logits."""
    a = make_llm(path, n_ctx=n_ctx)
    toks = tokens(a)
    n = len(toks)
    feed(a, toks)
    g = ek.geometry(a)
    full = state_blob(a)
    keep = random_keep(np.random.default_rng(seed), g.n_slots, n, n // 2, protect=8)
    ek.compact(a, keep)
    expected = oracle_blob(full, g, keep)
    assert state_blob(a) == expected
    b = make_llm(path, n_ctx=n_ctx)
    load_blob(b, expected, toks)
    ta, la = greedy(a, first if first is not None else toks[1], steps)
    tb, lb = greedy(b, first if first is not None else toks[1], steps)
    assert ta == tb and max(np.abs(x - y).max() for x, y in zip(la, lb)) <= 1e-5


def test_smollm2_same_keep_matches_seq_rm_oracle(smollm2):
    check_same_keep_against_seq_rm(smollm2, 512, (30, 90, 3), stride=2, n_probe=4)


def test_smollm2_per_head_compaction_matches_oracle_and_keeps_decoding(smollm2):
    check_per_head_keep_against_state_rewrite(smollm2, 512, seed=0, first=198, steps=24)


def test_gemma3_compacts_the_base_cache_and_leaves_swa_untouched(gemma3):
    a = make_llm(gemma3, n_ctx=512)
    toks = tokens(a)
    n = len(toks)
    feed(a, toks)
    g = ek.geometry(a)
    assert g.is_iswa and [l.il for l in g.layers] == [5, 11, 17]  # the full-attention layers
    full = state_blob(a)
    keep = random_keep(np.random.default_rng(1), g.n_slots, n, n // 3, protect=6)
    ek.compact(a, keep)
    after = state_blob(a)
    assert parse_cache(after).rest == parse_cache(full).rest, "the SWA cache changed"
    expected = oracle_blob(full, g, keep)
    assert after == expected
    b = make_llm(gemma3, n_ctx=512)
    load_blob(b, expected, toks)
    ta, la = greedy(a, 236764, 40)
    tb, lb = greedy(b, 236764, 40)
    assert ta == tb and max(np.abs(x - y).max() for x, y in zip(la, lb)) <= 1e-5
    assert ek.geometry(a).pos_max == n + 39


def test_gemma3_observes_and_evicts_only_its_full_attention_layers(gemma3):
    llm = make_llm(gemma3, n_ctx=512)
    toks = tokens(llm)
    feed(llm, toks[:-16])
    with ek.Observation(llm, 16) as obs:
        feed(llm, toks[-16:])
    s = obs.last
    assert list(s.layer_ids) == [5, 11, 17] and s.scores.shape[:2] == (3, 4) and s.n_head_kv == 1
    np.testing.assert_allclose(s.scores.sum(-1), 1.0, atol=1e-4)
    res = ek.EvictionController(budget=32, page_size=8, window=16).evict(llm, s)
    assert ek.geometry(llm).n_used == res.metrics["kept_tokens"] == 24 + (len(toks) % 8 or 8)
    assert res.metrics["policy_uor"] == 1.0 and res.metrics["uor_count"] == 3   # MQA: one group of 4 per layer
    assert 1.0 <= res.metrics["uor_mean"] <= res.metrics["uor_max"] <= 4.0
    ta, _ = greedy(llm, 236764, 12)
    assert len(ta) == 12


def test_qwen25_geometry_and_f32_compaction_matches_seq_rm_oracle(qwen25):
    """r = 7: 24 layers x 2 KV heads; the same keep on every slot equals llama.cpp's own
    seq_rm of the other positions (F32 cache: exact up to accumulation order)."""
    check_same_keep_against_seq_rm(qwen25, 256, (24, 48, 2), stride=3, n_probe=3)


def test_qwen25_per_head_compaction_matches_state_rewrite_oracle(qwen25):
    check_per_head_keep_against_state_rewrite(qwen25, 256, seed=2, first=None, steps=12)


def test_qwen25_every_group_keeps_one_exact_budget_while_the_heads_would_not(qwen25):
    """Seven query heads share each KV buffer: head-independent eviction's union grows past
    the budget, while page-entrokv and entrokv-edge keep exactly N pages per (layer, group)."""
    llm = make_llm(qwen25, n_ctx=512)
    toks = tokens(llm) * 8
    feed(llm, toks[:-16])
    with ek.Observation(llm, 16) as obs:
        feed(llm, toks[-16:])
    s = obs.last
    assert s.scores.shape[:2] == (24, 14) and s.n_head_kv == 2
    np.testing.assert_allclose(s.scores.sum(-1), 1.0, atol=1e-4)
    blob = state_blob(llm)
    for policy in ("page-entrokv", "entrokv-edge", "head-independent"):
        C.llama_memory_clear(llm._ctx.memory, True)
        load_blob(llm, blob, toks)
        m = ek.EvictionController(budget=0.25, window=16, policy=policy, lookahead=0 if policy == "entrokv-edge" else None
                           ).evict(llm, s).metrics
        assert m["uor_count"] == 48 and 1.0 <= m["uor_mean"] <= m["uor_max"] <= 7.0
        assert m["kv_bytes_kept"] == m["kv_bytes_engine"]
        if policy == "head-independent":
            assert m["kept_pages"] > m["budget_pages"]
        else:
            assert m["policy_uor"] == 1.0 and m["kept_pages"] == m["budget_pages"]
        out, _ = greedy(llm, toks[-1], 4)
        assert len(out) == 4


def test_gemma3_cache_too_small_for_its_sliding_window_is_refused_and_the_boundary_runs(gemma3):
    """Gemma 3's sliding-window layers keep the last n_swa (512) tokens plus a ubatch in a cache as
    large as the base one: below n_swa + n_ubatch cells llama_decode found no slot in the middle of
    a long prompt (a RuntimeError); now the constructor refuses it, and a cache at the boundary reads
    a prompt over twice its size, in pieces with evictions, to the end."""
    import pytest
    from entrokv_edge import EntroKVLlama
    with pytest.raises(ValueError, match="n_ctx must be >= 1024"):
        EntroKVLlama(str(gemma3), n_ctx=512, verbose=False)
    llm = EntroKVLlama(str(gemma3), n_ctx=768, n_batch=256, n_ubatch=256, verbose=False)
    toks = (tokens(llm)[1:] * 60)[:1800]
    llm.eval(toks)
    rep = llm.kv_report()
    assert rep["logical_tokens"] == 1800 and rep["evictions"] >= 3 and rep["kept_tokens"] <= 768
    out, _ = greedy(llm, toks[-1], 4)
    assert len(out) == 4


def _swa_part(blob: bytes):
    """The sliding-window cache's part of an iswa model's sequence state, parsed like the base's."""
    c = parse_cache(blob)
    return parse_cache(c.head + c.rest)


def _decode_at(llm, toks, n_past: int) -> np.ndarray:
    """Decode ``toks`` at positions n_past.. with llama_decode itself (llama-cpp-python's eval keeps
    its tokens in an array of n_ctx, too short for a sequence longer than the cache)."""
    llm._batch.set_batch(batch=[int(t) for t in toks], n_past=n_past, logits_all=False)
    llm._ctx.decode(llm._batch)
    return logits(llm)


def _greedy_at(llm, first: int, n_past: int, n: int):
    toks, outs, t = [], [], first
    for i in range(n):
        outs.append(_decode_at(llm, [t], n_past + i))
        t = int(np.argmax(outs[-1]))
        toks.append(t)
    return toks, outs


def test_gemma3_swa_trim_keeps_what_the_window_sees_in_position_order(gemma3):
    """Gemma 3's sliding-window cache (n_swa 512) after 1200 tokens whose cells wrapped around its
    1024 cells (the base cache compacted on the way): swa_trim keeps exactly the cells
    llama_state_seq_get_data writes (those the window has not passed), in position order at cells
    0..511, with their bytes; it decodes exactly like a context that loaded that state, and the
    same tokens as one that was not trimmed. It is refused until the base cache is compacted
    through the last position."""
    import pytest
    for fa in (False, True):
        a, b = make_llm(gemma3, n_ctx=1024, flash_attn=fa), make_llm(gemma3, n_ctx=1024, flash_attn=fa)
        toks = tokens(a)
        toks = toks[:1] + (toks[1:] * 40)[:1199]
        keep = np.tile(np.concatenate([np.arange(8), np.arange(508, 700)]), (ek.geometry(a).n_slots, 1)).astype(np.int32)
        for llm in (a, b):
            _decode_at(llm, toks[:700], 0)
            ek.compact(llm, keep)
            _decode_at(llm, toks[700:], 700)
        mem = a._ctx.memory
        assert C.llama_memory_seq_pos_min(mem, 0) == 176 and C.llama_memory_seq_pos_max(mem, 0) == 1199   # wrapped
        before = state_blob(a)
        with pytest.raises(ek.EntroKVError, match="right after a compaction"):     # compacted through 699 only
            ek.swa_trim(a)
        assert state_blob(a) == before
        ek.compact(a, np.tile(np.arange(700, dtype=np.int32), (ek.geometry(a).n_slots, 1)))   # through 1199, as it was
        assert state_blob(a) == before
        assert ek.swa_trim(a) == 1200 - 176 - 512
        after = state_blob(a)
        assert C.llama_memory_seq_pos_min(mem, 0) == 1199 - 511
        x, y = _swa_part(before), _swa_part(after)
        order = np.argsort(x.pos, kind="stable")
        assert x.pos.tolist() != sorted(x.pos.tolist()), "the ring did not wrap: the test lost its point"
        assert y.pos.tolist() == list(range(688, 1200))
        assert x.pos[order].tolist() == y.pos.tolist()
        for p, q in zip(x.k + x.v, y.k + y.v):
            assert p[:-1] == q[:-1]
            data = p[-1][order] if p[-1].shape[0] == len(order) else p[-1][:, order]     # V transposed: [n_embd, cells, el]
            assert np.array_equal(data, q[-1])
        assert parse_cache(after).k[0][2].tobytes() == parse_cache(before).k[0][2].tobytes()   # the base cache untouched
        assert ek.swa_trim(a) == 0 and state_blob(a) == after                                # a second trim: nothing to do
        c = make_llm(gemma3, n_ctx=1024, flash_attn=fa)
        buf = (ctypes.c_uint8 * len(after)).from_buffer_copy(after)
        assert C.llama_state_seq_set_data(c.ctx, buf, len(after), 0) == len(after)
        ta, la = _greedy_at(a, 236764, 1200, 24)
        tc, lc = _greedy_at(c, 236764, 1200, 24)
        tb, _ = _greedy_at(b, 236764, 1200, 24)
        assert ta == tc and max(np.abs(p - q).max() for p, q in zip(la, lc)) <= 1e-5
        # b reads the same keys among 512 masked cells: its sums run in another order, and through Q4 weights
        # (whose activations are quantized) that moves the logits by up to ~1.3 here, even with F32 caches
        assert ta == tb
        for llm in (a, b, c):
            llm.close()
    s = make_llm(gemma3, n_ctx=256)
    feed(s, tokens(s))
    n = len(tokens(s))
    ek.compact(s, np.tile(np.arange(n, dtype=np.int32), (ek.geometry(s).n_slots, 1)))
    blob = state_blob(s)
    assert ek.swa_trim(s) == 0 and state_blob(s) == blob           # shorter than the window: nothing passed


def test_gemma3_runtime_trims_at_each_eviction_and_a_cut_tail_decodes_again_the_same(gemma3):
    """EntroKVLlama's evictions trim the sliding-window cache (what its layers read drops to the
    window); tokens decoded after the eviction, removed and decoded again, give the same logits:
    the cells a cut above the eviction needs are all kept."""
    from entrokv_edge import EntroKVLlama
    llm = EntroKVLlama(str(gemma3), n_ctx=1024, n_batch=256, n_ubatch=256, budget=256, verbose=False, seed=0,
                       n_threads=2, n_threads_batch=2)
    toks = tokens(llm)
    toks = toks[:1] + (toks[1:] * 20)[:899]
    llm.eval(toks)
    m = llm.last_eviction.metrics
    mem = llm._ctx.memory
    assert m["swa_dropped"] == 900 - 512 and ek.geometry(llm).n_used == m["kept_tokens"] == 256
    assert C.llama_memory_seq_pos_min(mem, 0) == 900 - 512 and C.llama_memory_seq_pos_max(mem, 0) == 899
    tail = [236764, 669, 2255, 506, 1902, 563]
    first = [feed(llm, [t]) for t in tail]
    assert C.llama_memory_seq_pos_min(mem, 0) == 900 - 512    # no eviction since: nothing dropped
    assert llm._ctx.kv_cache_seq_rm(-1, 900, -1)
    llm.n_tokens = 900
    again = [feed(llm, [t]) for t in tail]
    assert max(np.abs(x - y).max() for x, y in zip(first, again)) == 0.0
    llm.close()


def test_swa_trim_is_refused_on_a_model_without_sliding_window_layers(smollm2):
    import pytest
    llm = make_llm(smollm2, n_ctx=256)
    feed(llm, tokens(llm))
    blob = state_blob(llm)
    with pytest.raises(ek.EntroKVError, match="no sliding-window cache"):
        ek.swa_trim(llm)
    assert state_blob(llm) == blob
