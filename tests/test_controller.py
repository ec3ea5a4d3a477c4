"""The controller end to end: prefill with observation, every policy through the same
compaction, metrics that agree with the engine, and the C one-call eviction."""
import codecs
import this  # noqa: F401  (the Zen of Python: a fixed English text shipped with Python)

import numpy as np
import pytest

import entrokv_edge as ek
from entrokv_edge.bindings import evict_native
from entrokv_edge.controller.config import EDGE_DEFAULTS
from helpers import feed, greedy, load_blob, make_llm, state_blob
from llama_cpp import llama_cpp as C

ZEN = codecs.decode(this.s, "rot13")


def long_text(n_lines):
    lines = [l for l in ZEN.splitlines() if l.strip()]
    return "\n".join(f"Rule {i}: {lines[i % len(lines)]}" for i in range(n_lines))


def observed_prefill(llm, toks, w):
    feed(llm, toks[:-w])
    with ek.Observation(llm, w) as obs:
        feed(llm, toks[-w:])
    return obs.last


def test_every_policy_on_smollm2_generates_and_accounts_memory_exactly(smollm2):
    llm = make_llm(smollm2, n_ctx=2048)
    toks = llm.tokenize(long_text(120).encode())[:1500]
    scores = observed_prefill(llm, toks, 32)
    blob = state_blob(llm)
    g = ek.geometry(llm)
    seen = {}
    for policy in ek.POLICIES:
        C.llama_memory_clear(llm._ctx.memory, True)
        load_blob(llm, blob, toks)
        res = ek.EvictionController(budget=0.2, policy=policy).evict(llm, scores)
        m = res.metrics
        assert m["kv_bytes_kept"] == m["kv_bytes_engine"] == ek.geometry(llm).n_used * g.bytes_per_cell
        assert m["uor_count"] == 90 and 1.0 <= m["uor_mean"] <= m["uor_max"] <= 3.0
        P = m["page_size"]                     # 16, or entrokv-edge's default
        assert P == (EDGE_DEFAULTS["page_size"] if policy == "entrokv-edge" else 16)
        assert m["budget_pages"] == (1500 * 2 // 10) // P or policy == "full"
        if policy in ("head-independent", "full"):
            assert m["kept_pages"] >= m["budget_pages"]
        else:                                  # N pages, the last one (always kept) holding the prompt's tail
            last = 1500 - (-(-1500 // P) - 1) * P
            assert m["policy_uor"] == 1.0 and m["kept_tokens"] == (m["budget_pages"] - 1) * P + last
        toks_out, _ = greedy(llm, toks[-1], 8)
        text = llm.detokenize(toks_out).decode("utf-8", "replace")
        assert len(toks_out) == 8 and text.strip(), policy
        seen[policy] = res.positions
        assert res.to_json().startswith("{")
    assert not np.array_equal(seen["page-entrokv"], seen["streaming"])


def test_c_one_call_eviction_equals_the_python_controller(synth_models):
    path = synth_models["llama-r3"]
    toks = np.random.default_rng(0).integers(3, 300, 150)
    a, b = make_llm(path), make_llm(path)
    sa = observed_prefill(a, toks, 16)
    observed_prefill(b, toks, 16)
    ek.EvictionController(budget=48, page_size=8, window=16, sinks=4, policy="page-entrokv").evict(a, sa)
    kept = evict_native(b, budget=48, page_size=8, sinks=4, recent=16)
    assert kept == ek.geometry(a).n_used == 48 - 8 + 150 % 8
    assert state_blob(a) == state_blob(b)
    assert np.array_equal(ek.true_positions(a), ek.true_positions(b))


def test_prefill_controller_and_its_refusals(synth_models):
    path = synth_models["llama-r2"]
    llm = make_llm(path)
    toks = np.random.default_rng(1).integers(3, 300, 120)
    with pytest.raises(ValueError, match="longer than the prompt"):
        ek.EvictionController(window=32).prefill(llm, toks[:20])
    with pytest.raises(ValueError, match="protected pages"):
        ek.EvictionController(budget=8, page_size=8).prefill(llm, toks)
    assert ek.geometry(llm).n_used == 0                       # nothing was evaluated
    res = ek.EvictionController(budget=0.5, page_size=8, window=16).prefill(llm, toks, needles=[60, 61])
    assert ek.geometry(llm).n_used == res.metrics["kept_tokens"] == 56   # 7 pages of 8 (120 = 15 pages)
    kept = set(res.positions[0, 0].tolist())
    assert res.metrics["needle_kept"][0][0] == ({60, 61} <= kept)
    assert np.array(res.metrics["needle_kept"]).shape == (2, 3)          # (layers, KV heads)
    with pytest.raises(ValueError, match="empty context"):
        ek.EvictionController(budget=0.5, page_size=8, window=16).prefill(llm, toks)
    with pytest.raises(TypeError):
        ek.EvictionController(ek.EvictionConfig(), budget=0.3)
    assert ek.PageEntroKV is ek.EvictionController          # the name the README first documented


def test_head_metrics_match_the_token_level_definitions(synth_models):
    from entrokv_edge.controller.weights import collision, head_weights, isolate_sinks, masquerade_ratio, sink_mass
    llm = make_llm(synth_models["llama-r3"])
    toks = np.random.default_rng(7).integers(3, 300, 130)
    s = observed_prefill(llm, toks, 16)
    m = ek.EvictionController(budget=64, page_size=8, window=16, policy="page-entrokv").evict(llm, s).metrics["heads"]
    sc = s.scores[:, :, :130]
    c = collision(isolate_sinks(sc, 4)[0])
    np.testing.assert_allclose(m["collision_entropy"], -np.log(c), rtol=1e-9)
    np.testing.assert_allclose(m["weights"], head_weights(c, 3), rtol=1e-9)
    np.testing.assert_allclose(m["sink_mass"], sink_mass(sc, 4), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(m["masquerade_ratio"], masquerade_ratio(sc, 4, 3), rtol=1e-9)


def test_scores_by_position_against_a_cell_by_cell_reference():
    """Window scores moved from the cells they were observed on to true positions, per (layer,
    query head): a position the head's buffer holds gets its observed score (the last cell
    listing it), a held position never observed the mean of the head's observed held ones,
    every other position 0; and which positions each group still holds. Random cells, some
    empty, observations that saw other (and later) positions, duplicates."""
    from types import SimpleNamespace
    from entrokv_edge.runtime.eviction import EvictionController
    rng = np.random.default_rng(11)
    for _ in range(60):
        L, G, r = (int(x) for x in rng.integers(1, 4, size=3))
        H, n, kv = G * r, int(rng.integers(5, 120)), int(rng.integers(4, 90))
        tp_now = np.full((L * G, kv), -1, np.int32)
        for si in range(L * G):
            m = min(kv, n, int(rng.integers(1, kv + 1)))
            tp_now[si, rng.permutation(kv)[:m]] = rng.choice(n, m, replace=False)
        n_kv = int(rng.integers(1, kv + 1))
        tp_obs = np.where(rng.random((L * G, n_kv)) < 0.8, rng.integers(-1, n + 3, (L * G, n_kv)), -1).astype(np.int32)
        obs = SimpleNamespace(true_pos=tp_obs, scores=rng.random((L, H, n_kv)))
        present = EvictionController._by_position(tp_now, n, tp_now >= 0).reshape(L, G, n)
        assert present.shape == (L, G, n)
        for l in range(L):
            sl = EvictionController._layer_scores_by_position(obs, present, l, n, H, r)
            assert sl.shape == (H, n)
            for h in range(H):
                slot = l * G + h // r
                held = {int(p) for p in tp_now[slot] if 0 <= p < n}
                assert present[l, h // r].tolist() == [p in held for p in range(n)]
                seen = {}
                for c in range(n_kv):
                    if 0 <= tp_obs[slot, c] < n:
                        seen[int(tp_obs[slot, c])] = obs.scores[l, h, c]
                known = [seen[p] for p in sorted(held) if p in seen]
                fill = sum(known) / max(len(known), 1)
                want = [(seen[p] if p in seen else fill) if p in held else 0.0 for p in range(n)]
                np.testing.assert_allclose(sl[h], want, rtol=1e-12, atol=0)
