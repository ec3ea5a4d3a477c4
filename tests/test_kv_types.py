"""Quantized KV caches (llama.cpp's -ctk / -ctv): the runtime on q8_0 and q4_0 caches against the state-rewrite
oracle, sessions that carry the type, the command line's flags and refusals, the full policy running whatever
fits, and numpy's BLAS held to the runtime's threads."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import entrokv_edge as ek
from helpers import logits
from test_cli import cli

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import soak as S  # noqa: E402

SETTINGS = dict(budget=64, page_size=8, window=16, verbose=False, seed=0, n_threads=2, n_threads_batch=2)
QUANTIZED = {"q8_0": 8, "q4_0": 2}


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_a_chat_on_a_quantized_cache_matches_the_oracle_at_every_eviction(synth_models, name):
    """Prompts longer than the cache (guided evictions between pieces) and decoding that fills it, on a quantized
    K and V: every eviction's bytes, true positions and next logits as the state-rewrite oracle's."""
    t = QUANTIZED[name]
    llm = S.make(str(synth_models["llama-r3"]), 256, 1, type_k=t, type_v=t, flash_attn=True, budget=64, window=16,
                 page_size=8, guide=16)
    assert ek.geometry(llm).type_k == name == ek.geometry(llm).type_v
    rng = np.random.default_rng(1)
    turns = [[int(x) for x in rng.integers(3, 300, int(rng.integers(40, 360)))] for _ in range(4)]
    r = S.soak(llm, turns, answer=48, warmup=1)
    assert r["evictions"] >= 5 and any(c["tokens_after"] == 1 for c in r["checks"])
    assert r["checked"] == r["blob_equal"] == r["table_equal"] == r["evictions"], r["checks"]
    assert r["max_logit_diff"] <= 1e-5
    assert llm.kv_report()["kept_tokens"] <= 256 and llm.stats.guided > 0


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_a_session_of_a_quantized_cache_carries_its_type(synth_models, tmp_path, name):
    t = QUANTIZED[name]
    path = str(synth_models["llama-r3"])
    a = ek.EntroKVLlama(path, n_ctx=256, type_k=name, type_v=name, flash_attn=True, **SETTINGS)   # by name too
    a.eval(prompt(500, 2))
    a.save_session(tmp_path / "q.entrokv")
    b = ek.EntroKVLlama(path, n_ctx=256, type_k=t, type_v=t, flash_attn=True, **SETTINGS)
    b.load_session(tmp_path / "q.entrokv")
    assert np.array_equal(logits(a), logits(b)) and np.array_equal(ek.true_positions(a), ek.true_positions(b))
    f16 = ek.EntroKVLlama(path, n_ctx=256, **SETTINGS)
    with pytest.raises(ek.SessionError, match="another cache layout or type"):
        f16.load_session(tmp_path / "q.entrokv")


def test_cache_types_are_checked_before_llama_cpp_sees_them(synth_models):
    path = str(synth_models["llama-r3"])
    with pytest.raises(ValueError, match="needs flash attention"):
        ek.EntroKVLlama(path, n_ctx=256, type_k="q4_0", type_v="q4_0", **SETTINGS)
    with pytest.raises(ValueError, match="unknown KV cache type 'q2_k'"):
        ek.EntroKVLlama(path, n_ctx=256, type_k="q2_k", **SETTINGS)
    k_only = ek.EntroKVLlama(path, n_ctx=256, type_k="q8_0", **SETTINGS)      # a quantized K alone needs none
    assert ek.geometry(k_only).type_k == "q8_0" and ek.geometry(k_only).type_v == "f16"


def test_the_command_line_sets_the_cache_types(smollm2):
    text = " ".join(f"The {c} box holds item {i}." for i, c in enumerate(["red", "blue", "green"] * 30))
    rc, out, err = cli("run", "-m", smollm2, "-p", text + " Which box holds item 4?", "--max-tokens", 4,
                       "-ctk", "q8_0", "-ctv", "q4_0", "--json")
    assert rc == 0, err
    out = json.loads(out)
    f16 = json.loads(cli("run", "-m", smollm2, "-p", text + " Which box holds item 4?", "--max-tokens", 4, "--json")[1])
    # K at 34 bytes and V at 18 per 32 elements, against 64 each
    assert out["answer"].strip() and abs(out["kv_bytes_kept"] / f16["kv_bytes_kept"] - (34 + 18) / 128) < 1e-9
    rc, _, err = cli("run", "-m", smollm2, "-p", "hi", "-ctv", "q4_0", "-fa", "off")
    assert rc == 2 and err.strip().splitlines() == [
        "entrokv-edge: a quantized V cache (q4_0) needs flash attention: give -fa on (or leave it auto)"]
    rc, _, err = cli("run", "-m", smollm2, "-p", "hi", "-ctk", "q2_k")
    assert rc == 2 and "unknown cache type 'q2_k'" in err and len(err.strip().splitlines()) == 1


def test_the_full_policy_runs_what_fits_and_names_the_cells_it_needs(smollm2):
    doc = Path(__file__).parent.parent / "docs" / "sample.txt"          # about 2,700 tokens
    rc, out, err = cli("run", "-m", smollm2, "-f", doc, "-p", "Who keeps the ledger?", "--policy", "full",
                       "--kv-cells", 3328, "--max-tokens", 8, "--json")
    assert rc == 0, err
    out = json.loads(out)
    assert out["evictions"] == 0 and out["kept_tokens"] == out["logical_tokens"]
    rc, _, err = cli("run", "-m", smollm2, "-f", doc, "-p", "Who keeps the ledger?", "--policy", "full",
                     "--kv-cells", 1024, "--max-tokens", 8)
    assert rc == 2 and "the full policy keeps every token" in err and "this one has 1024" in err


def test_numpys_blas_runs_on_the_runtimes_threads_inside_eval(synth_models):
    from threadpoolctl import threadpool_info
    seen = []
    before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    llm = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=256, **{**SETTINGS, "n_threads": 1})
    llm.events.listen("evicting", lambda rt, controller, scores, aside: seen.append(
        [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]))
    llm.eval(prompt(500, 4))
    assert seen and all(n == [1] * len(n) and n for n in seen), seen
    assert [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] == before   # given back after
