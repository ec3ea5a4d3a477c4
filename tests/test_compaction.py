"""Compaction per (layer, KV head) against independent oracles, on synthetic models."""
import numpy as np
import pytest

import entrokv_edge as ek
from helpers import feed, greedy, load_blob, make_llm, oracle_blob, random_keep, state_blob

N = 48  # prompt tokens

# (type_k, type_v, flash_attn): V quantization needs flash attention in llama.cpp
CACHE_CONFIGS = [
    ("f32", "f32", False),
    ("f16", "f16", False),
    ("f16", "f16", True),
    ("q8_0", "q8_0", True),
    ("q4_0", "q4_0", True),
    ("q8_0", "f16", False),
    ("q4_0", "f16", False),
]


def prompt(seed, n=N):
    return np.random.default_rng(seed).integers(3, 300, n)


def twins(path, **kw):
    return make_llm(path, **kw), make_llm(path, **kw)


@pytest.mark.parametrize("model", ["llama-r1", "llama-r2", "llama-r3", "llama-r6", "qwen2-r3"])
def test_permutation_of_every_cell_leaves_logits_unchanged(synth_models, model):
    # F32 cache: with F16 the changed accumulation order alone moves logits by ~1e-3
    a, b = twins(synth_models[model], type_k="f32")
    toks = prompt(1)
    feed(a, toks), feed(b, toks)
    g = ek.geometry(a)
    rng = np.random.default_rng(7)
    perm = np.stack([rng.permutation(N) for _ in range(g.n_slots)]).astype(np.int32)
    assert (perm != np.arange(N)).any(axis=1).all(), "every slot gets a non-identity order"
    ek.compact(a, perm, unordered=True)
    assert (ek.true_positions(a)[:, :N] == perm).all()
    for t in (5, 77, 123, 9):
        la, lb = feed(a, [t]), feed(b, [t])
        assert np.abs(la - lb).max() < 1e-4


@pytest.mark.parametrize("graph", [False, True], ids=["host", "graph"])
@pytest.mark.parametrize("model", ["llama-r2", "llama-r3", "qwen2-r2"])
def test_same_keep_for_every_head_matches_seq_rm_holes(synth_models, model, graph):
    a, b = twins(synth_models[model], type_k="f32")
    toks = prompt(2)
    feed(a, toks), feed(b, toks)
    g = ek.geometry(a)
    rng = np.random.default_rng(3)
    keep = np.sort(np.concatenate([rng.choice(N - 8, 12, replace=False), np.arange(N - 8, N)]))
    ek.compact(a, np.tile(keep, (g.n_slots, 1)).astype(np.int32), graph=graph)
    for p in sorted(set(range(N)) - set(keep.tolist())):
        assert b._ctx.kv_cache_seq_rm(0, p, p + 1)
    assert ek.geometry(a).n_used == len(keep) == ek.geometry(b).n_used
    for t in (11, 250, 42, 7, 199, 3):  # several further decoded tokens
        la, lb = feed(a, [t]), feed(b, [t])
        assert np.abs(la - lb).max() < 1e-4


@pytest.mark.parametrize("graph", [False, True], ids=["host", "graph"])
@pytest.mark.parametrize("type_k,type_v,fa", CACHE_CONFIGS)
def test_per_head_keep_sets_match_state_rewrite_oracle(synth_models, type_k, type_v, fa, graph):
    path = synth_models["llama-r3"]
    a = make_llm(path, type_k=type_k, type_v=type_v, flash_attn=fa)
    toks = prompt(4)
    feed(a, toks)
    g = ek.geometry(a)
    assert g.type_k == type_k and g.type_v == type_v and g.v_trans == (not fa)
    full = state_blob(a)
    keep = random_keep(np.random.default_rng(5), g.n_slots, N, 20, protect=4)
    ek.compact(a, keep, graph=graph)
    expected = oracle_blob(full, g, keep)
    assert state_blob(a) == expected, "the compacted cache differs from the Python rewrite of the state"
    assert (ek.true_positions(a)[:, :20] == keep).all()

    b = make_llm(path, type_k=type_k, type_v=type_v, flash_attn=fa)
    load_blob(b, expected, toks)
    n_steps = 110 if (type_k, fa) in {("f16", False), ("q4_0", True)} else 12
    ta, la = greedy(a, 17, n_steps)
    tb, lb = greedy(b, 17, n_steps)
    assert ta == tb
    assert max(np.abs(x - y).max() for x, y in zip(la, lb)) <= 1e-5
    assert ek.geometry(a).pos_max == N + n_steps - 1


@pytest.mark.parametrize("type_k,type_v,fa", CACHE_CONFIGS)
def test_host_and_graph_paths_write_identical_bytes(synth_models, type_k, type_v, fa):
    a, b = twins(synth_models["llama-r2"], type_k=type_k, type_v=type_v, flash_attn=fa)
    toks = prompt(6)
    feed(a, toks), feed(b, toks)
    keep = random_keep(np.random.default_rng(8), ek.geometry(a).n_slots, N, 16, protect=2)
    ek.compact(a, keep, graph=False)
    ek.compact(b, keep, graph=True)
    assert state_blob(a) == state_blob(b)


@pytest.mark.parametrize("graph", [False, True], ids=["host", "graph"])
def test_repeated_compaction_composes_true_positions(synth_models, graph):
    path = synth_models["llama-r3"]
    a = make_llm(path, type_k="f32")
    toks = prompt(9)
    feed(a, toks)
    g = ek.geometry(a)
    full_blob = state_blob(a)
    rng = np.random.default_rng(10)
    k1 = random_keep(rng, g.n_slots, N, 24, protect=4)
    ek.compact(a, k1, graph=graph)
    more = [31, 64, 2 + 3, 99, 150, 201, 18, 77, 5, 260]
    feed(a, more)
    tp = ek.true_positions(a)
    assert (tp[:, :24] == k1).all() and (tp[:, 24:34] == np.arange(N, N + 10)).all()

    k2 = random_keep(rng, g.n_slots, 34, 16, protect=3)
    ek.compact(a, k2, graph=graph)
    expected = np.take_along_axis(tp[:, :34], k2, axis=1)
    g2 = ek.geometry(a)
    assert g2.n_compactions == 2 and g2.n_compacted == 16 and g2.n_used == 16
    assert (ek.true_positions(a)[:, :16] == expected).all()
    assert (ek.true_positions(a)[:, 16:] == -1).all()

    # oracle: replay the same history through state rewrites (the tokens decoded after the first
    # compaction attended only to what it kept, so their K/V come from that history)
    b1 = make_llm(path, type_k="f32")
    load_blob(b1, oracle_blob(full_blob, g, k1), toks)
    feed(b1, more)
    b2 = make_llm(path, type_k="f32")
    load_blob(b2, oracle_blob(state_blob(b1), g, k2), list(toks) + more)
    assert state_blob(a) == state_blob(b2)
    for t in (8, 120, 33):
        assert np.abs(feed(a, [t]) - feed(b2, [t])).max() < 1e-5


@pytest.mark.parametrize("type_k,type_v,fa", CACHE_CONFIGS)
def test_host_and_graph_paths_write_identical_bytes_for_lists_in_any_order(synth_models, type_k, type_v, fa):
    """Lists in any order (what swa_trim gives a wrapped sliding-window cache): the graph path, which
    other backends take, copies its sources before it writes, like the host path's gather."""
    a, b = twins(synth_models["llama-r2"], type_k=type_k, type_v=type_v, flash_attn=fa)
    toks = prompt(6)
    feed(a, toks), feed(b, toks)
    rng = np.random.default_rng(12)
    lists = np.stack([rng.permutation(N)[:24] for _ in range(ek.geometry(a).n_slots)]).astype(np.int32)
    ek.compact(a, lists, unordered=True, graph=False)
    ek.compact(b, lists, unordered=True, graph=True)
    assert state_blob(a) == state_blob(b)
