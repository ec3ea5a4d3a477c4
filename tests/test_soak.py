"""A short soak (benchmarks/soak.py): a ten-turn chat through a 256-cell F32 cache of a synthetic
model, every eviction (during prompts and while decoding, on caches evicted before) checked against
the state-rewrite oracle: the same bytes, the same true positions, the same next logits; and memory
that does not grow per turn."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import soak as S  # noqa: E402


def test_a_ten_turn_chat_matches_the_oracle_at_every_eviction(synth_models):
    llm = S.make(str(synth_models["llama-r3"]), 256, 1, budget=64, window=16, page_size=8)
    rng = np.random.default_rng(0)
    turns = [[int(t) for t in rng.integers(3, 300, int(rng.integers(40, 360)))] for _ in range(10)]
    r = S.soak(llm, turns, answer=64, warmup=3)
    assert r["decoded_tokens"] >= 640 and r["evictions"] >= 12
    assert any(c["tokens_after"] == 1 for c in r["checks"]), "evictions while decoding"
    assert any(c["tokens_after"] > 1 for c in r["checks"]), "evictions before prompt pieces"
    assert r["checked"] == r["blob_equal"] == r["table_equal"] == r["evictions"], r["checks"]
    assert r["max_logit_diff"] <= 1e-5
    assert r["malloc_slope_mib_per_turn"] < 0.25, r["malloc_mib"]       # what malloc holds: no growth per turn


def test_the_mirror_maps_compacted_cells_to_the_kept_positions():
    m = S.Mirror()
    pos = np.arange(6)
    assert (m.table(pos, 2) == pos).all()
    m.evicted(np.array([[0, 3, 5], [1, 2, 5]]), 6)          # 6 logical tokens, 3 kept: cells at positions 3..5
    t = m.table(np.array([3, 4, 5, 6, 7]), 2)               # then two more tokens
    assert t.tolist() == [[0, 3, 5, 6, 7], [1, 2, 5, 6, 7]]
