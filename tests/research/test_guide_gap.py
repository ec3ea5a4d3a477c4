"""The oracle of benchmarks/research/guide_gap.py: a prompt read in pieces with a given selection
favoured at every eviction ends with that selection, where the plain read keeps another."""
import sys
from pathlib import Path

import numpy as np

import entrokv_edge as ek

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "research"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_a_favoured_selection_survives_a_read_in_pieces(synth_models):
    import guide_gap as GG
    path = str(synth_models["llama-r3"])
    # the favour is per buffer: no consensus, which puts pages into every buffer alike (guide_gap's oracle runs so too)
    cfg = ek.EvictionConfig(budget=64, page_size=8, window=16, guide=16, guide_consensus=0.0)
    settings = dict(verbose=False, seed=0, n_threads=2, n_threads_batch=2)
    toks = [int(t) for t in np.random.default_rng(9).integers(3, 300, 600)]
    whole = ek.EntroKVLlama(path, n_ctx=1024, eviction=cfg, **settings)
    whole.eval(toks)                                     # fits: one eviction after the prompt, to 64 tokens
    assert whole.stats.evictions == 1
    S = GG._kept(whole)
    small = ek.EntroKVLlama(path, n_ctx=256, eviction=GG.favoured(ek.policy_for(cfg)), **settings)
    small.eval(toks)
    assert small.stats.evictions > 2
    plain = GG._overlap(GG._kept(small), S)
    g = ek.geometry(small)
    L, G = len(g.layers), g.layers[0].n_head_kv
    mask = np.zeros((L, G, len(toks) + 1), dtype=bool)
    for slot, pos in enumerate(S):
        mask[slot // G, slot % G, pos] = True
    GG._favour["mask"] = mask
    try:
        small.reset()
        small.eval(toks)
    finally:
        GG._favour["mask"] = None
    favoured = GG._overlap(GG._kept(small), S)
    assert favoured == 1.0 > plain
    small.reset()
    small.eval(toks)                                     # the bonus is gone once the mask is
    assert GG._overlap(GG._kept(small), S) == plain
