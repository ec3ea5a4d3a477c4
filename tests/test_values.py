"""Value norms (llama_entrokv_value_norms, the option value_power) against an independent
reference: the serialized sequence state parsed and dequantized in numpy."""
import numpy as np
import pytest

import entrokv_edge as ek
from entrokv_edge.runtime.eviction import EvictionController
from helpers import make_llm, parse_cache, random_keep, state_blob
from test_compaction import CACHE_CONFIGS, prompt

N = 48


def _f16(raw):
    return np.frombuffer(raw.tobytes(), dtype=np.float16).astype(np.float64)


def dequantize(t: int, raw: np.ndarray) -> np.ndarray:
    """float64 values of a run of elements of ggml type t, in numpy (ggml's block layouts)."""
    if t == 0:
        return np.frombuffer(raw.tobytes(), dtype=np.float32).astype(np.float64)
    if t == 1:
        return _f16(raw)
    b = raw.reshape(-1, 34 if t == 8 else 18)
    d = _f16(np.ascontiguousarray(b[:, :2]))[:, None]
    if t == 8:      # q8_0: f16 scale, 32 int8
        return (d * b[:, 2:].view(np.int8)).reshape(-1)
    if t == 2:      # q4_0: f16 scale, 16 bytes: low nibbles are elements 0..15, high 16..31
        q = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1).astype(np.float64) - 8
        return (d * q).reshape(-1)
    raise NotImplementedError(t)


def reference_norms(blob: bytes, geo) -> np.ndarray:
    """float64 [n_slots, n_cells]: ||v|| per slot and serialized cell, from the state bytes."""
    c = parse_cache(blob)
    n = len(c.pos)
    out = np.zeros((geo.n_slots, n))
    for li, layer in enumerate(geo.layers):
        nh, hd = layer.n_head_kv, layer.head_dim_v
        if not c.v_trans:
            t, row, data = c.v[li]
            v = np.stack([dequantize(t, data[i]) for i in range(n)])                # [n, nh * hd]
        else:
            t, el, ne, data = c.v[li]
            v = np.stack([dequantize(t, data[j].reshape(-1)) for j in range(ne)]).T  # [n, ne]
        v = v.reshape(n, nh, hd)
        out[layer.slot0: layer.slot0 + nh] = np.sqrt((v ** 2).sum(-1)).T
    return out


@pytest.mark.parametrize("type_k,type_v,fa", CACHE_CONFIGS)
@pytest.mark.parametrize("model", ["llama-r3", "qwen2-r2"])
def test_value_norms_equal_the_dequantized_state(synth_models, model, type_k, type_v, fa):
    """Every cache type and layout (V rows with flash attention, transposed without): the
    native norms equal numpy's from the serialized cache; empty cells are 0."""
    llm = make_llm(synth_models[model], type_k=type_k, type_v=type_v, flash_attn=fa)
    llm.eval([int(t) for t in prompt(5)])
    g = ek.geometry(llm)
    assert g.type_v == type_v and g.v_trans == (not fa)
    got = ek.value_norms(llm)
    assert got.shape == (g.n_slots, g.kv_size) and got.dtype == np.float32
    ref = reference_norms(state_blob(llm), g)
    np.testing.assert_allclose(got[:, :N], ref, rtol=2e-6, atol=1e-6)
    assert (got[:, :N] > 0).all() and not got[:, N:].any()
    assert len(set(np.round(ref[:, 5], 6))) > 1          # heads and layers differ: a real check


@pytest.mark.parametrize("fa", [False, True])
def test_value_norms_follow_their_tokens_through_a_compaction(synth_models, fa):
    """After a per-head compaction each slot's kept tokens sit in other cells; the norms by
    true position (what the controller gives the selection) are the ones before it."""
    llm = make_llm(synth_models["llama-r3"], type_k="f16", flash_attn=fa)
    llm.eval([int(t) for t in prompt(6)])
    g = ek.geometry(llm)
    L, G = g.n_layers, g.layers[0].n_head_kv
    before = EvictionController._values_by_position(llm, None, N, L, G)
    keep = random_keep(np.random.default_rng(1), g.n_slots, N, 20, protect=4)
    ek.compact(llm, keep)
    tp = ek.true_positions(llm)
    after = EvictionController._values_by_position(llm, tp, N, L, G).reshape(g.n_slots, N)
    kept = np.zeros((g.n_slots, N), dtype=bool)
    kept[np.arange(g.n_slots)[:, None], keep] = True
    np.testing.assert_array_equal(after[kept], before.reshape(g.n_slots, N)[kept])
    assert not after[~kept].any()


@pytest.mark.parametrize("fa", [False, True])
def test_value_norms_of_freed_cells_are_0_and_the_others_the_states(synth_models, fa):
    """A hole cut with seq_rm (cells 10..19 freed, the cells after them still in use), then a
    per-head compaction and more tokens decoded after it: each time the native norms of the
    cells in use equal the reference's (the state serializes exactly those cells) and every
    other cell reads 0."""
    from llama_cpp import llama_cpp as C
    llm = make_llm(synth_models["llama-r3"], type_k="f16", flash_attn=fa)
    llm.eval([int(t) for t in prompt(9)])
    assert C.llama_memory_seq_rm(llm._ctx.memory, 0, 10, 20)

    def check():
        got, g = ek.value_norms(llm), ek.geometry(llm)
        used = np.zeros(g.kv_size, dtype=bool)
        used[np.unique(np.nonzero(ek.true_positions(llm) >= 0)[1])] = True
        np.testing.assert_allclose(got[:, used], reference_norms(state_blob(llm), g), rtol=2e-6, atol=1e-6)
        assert (got[:, used] > 0).all() and not got[:, ~used].any()
        return used

    used = check()
    assert not used[10:20].any() and used[:10].all() and used[20:N].all()
    # compaction: each slot's kept tokens move to cells 0..K-1; then 5 more tokens are decoded
    llm = make_llm(synth_models["llama-r3"], type_k="f16", flash_attn=fa)
    llm.eval([int(t) for t in prompt(9)])
    g = ek.geometry(llm)
    ek.compact(llm, random_keep(np.random.default_rng(2), g.n_slots, N, 20, protect=4))
    llm.eval([7, 8, 9, 10, 11])
    assert check().sum() == 25
    # the controller's map by true position: the decoded tokens (positions N..N+4) keep their own norms
    tp = ek.true_positions(llm)
    by_pos = EvictionController._values_by_position(llm, tp, N + 5, g.n_layers, g.layers[0].n_head_kv).reshape(g.n_slots, -1)
    vn = ek.value_norms(llm)
    want = np.array([[vn[s, np.flatnonzero(tp[s] == p)[0]] for p in range(N, N + 5)] for s in range(g.n_slots)])
    np.testing.assert_array_equal(by_pos[:, N:], want)


def test_value_norms_refuse_a_short_buffer_and_a_null_context(synth_models):
    from entrokv_edge.bindings.native import c_api, context_pointer
    ffi, lib = c_api()
    llm = make_llm(synth_models["llama-r2"])
    llm.eval([int(t) for t in prompt(7)])
    g = ek.geometry(llm)
    out = np.full(g.n_slots * g.kv_size - 1, 7.0, dtype=np.float32)
    rc = lib.llama_entrokv_value_norms(context_pointer(llm), ffi.from_buffer("float[]", out), out.size)
    assert rc == lib.LLAMA_ENTROKV_ERR_BUFFER_SIZE and (out == 7.0).all()
    assert "need n_slots * kv_size" in ffi.string(lib.llama_entrokv_last_error()).decode()
    assert lib.llama_entrokv_value_norms(ffi.NULL, ffi.from_buffer("float[]", out), out.size) == \
        lib.LLAMA_ENTROKV_ERR_INVALID_ARG
    assert lib.llama_entrokv_value_norms(context_pointer(llm), ffi.NULL, out.size + 1) == \
        lib.LLAMA_ENTROKV_ERR_INVALID_ARG


def test_value_power_selects_from_the_value_weighted_scores(synth_models):
    """The controller with value_power = a evicts exactly the pages that select() picks from
    the window scores times the reference norms ** a, and those differ from a = 0's."""
    path = synth_models["llama-r3"]
    picks = {}
    for a in (0.0, 2.0):
        llm = make_llm(path, n_ctx=256, type_k="f32")
        toks = [int(t) for t in prompt(8, 160)]
        cfg = ek.EvictionConfig(budget=64, page_size=4, window=16, value_power=a)
        llm.eval(toks[:-16])
        with ek.Observation(llm, 16) as obs:
            llm.eval(toks[-16:])
        g = ek.geometry(llm)
        ref = reference_norms(state_blob(llm), g).reshape(g.n_layers, g.layers[0].n_head_kv, -1)
        s = obs.last.scores[:, :, :160]
        want = ek.controller.policies.select(s, 3, cfg, 160, values=ref.astype(np.float32)).pages
        res = EvictionController(cfg).evict(llm, obs.last)
        np.testing.assert_array_equal(res.selection.pages, want)
        assert ek.geometry(llm).n_used == 64
        picks[a] = want
    assert not np.array_equal(picks[0.0], picks[2.0])


@pytest.mark.parametrize("fa", [False, True])
def test_value_norms_of_a_real_iswa_model(gemma3, fa):
    """Gemma 3 270M (Q8_0 weights, an iswa model): the norms of its full-attention cache (the
    one llama_entrokv acts on) equal the reference's from the first cache in its state."""
    llm = make_llm(gemma3, n_ctx=256, type_k="f16", flash_attn=fa)
    llm.eval(llm.tokenize(b"The locker with the otter sticker opens with code 4812. " * 6))
    g = ek.geometry(llm)
    assert g.is_iswa and g.v_trans == (not fa)
    got, n = ek.value_norms(llm), g.n_used
    np.testing.assert_allclose(got[:, :n], reference_norms(state_blob(llm), g), rtol=2e-6, atol=1e-6)
    assert (got[:, :n] > 0).all() and not got[:, n:].any()
