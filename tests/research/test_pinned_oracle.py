"""The oracle of benchmarks/research/pinned_oracle.py: a pinned sentence stays in every group buffer through a
read in pieces and a later turn's recall, at the same budget; without the pin some buffer drops it."""
import sys
from pathlib import Path

import numpy as np

import entrokv_edge as ek

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "research"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _holds(llm, span) -> np.ndarray:
    """Per group buffer: whether it holds every position of span."""
    return np.array([np.isin(span, row).all() for row in ek.true_positions(llm)])


def test_a_pinned_sentence_stays_in_every_buffer(synth_models):
    import pinned_oracle as PO
    path = str(synth_models["llama-r3"])
    toks = [int(t) for t in np.random.default_rng(3).integers(3, 200, 700)]
    fact = list(range(230, 246))                  # token ids the haystack never uses: found once
    toks[200:216] = fact
    span = np.arange(200, 216)
    turn = [int(t) for t in np.random.default_rng(4).integers(3, 200, 24)]
    cfg = ek.EvictionConfig(budget=64, page_size=8, window=16)
    settings = dict(n_ctx=256, verbose=False, seed=0, n_threads=2, n_threads_batch=2, recall=True)
    kept, held = {}, {}
    for pinned in (False, True):
        llm = ek.EntroKVLlama(path, eviction=PO.pinned(ek.policy_for(cfg)), **settings)
        PO.PIN.update(llm=llm, seqs=[fact[1:-1]] if pinned else [], head=0, at={})
        try:
            llm.eval(toks)                            # read in pieces: evictions between them and after
            assert llm.stats.evictions > 2
            kept[pinned] = ek.geometry(llm).n_used
            held[pinned] = _holds(llm, span)
            llm.eval(turn)                            # a later turn: its recall swaps pages in and out
            assert llm.kv_report()["recall"]["recalled_tokens"] > 0
            held[pinned] &= _holds(llm, span)
        finally:
            PO.PIN.update(llm=None, seqs=[], at={})
            llm.close()
    assert held[True].all(), held[True]
    assert not held[False].all()                      # the pin is what keeps it: unpinned, some buffer drops it
    assert kept[True] == kept[False]                  # the same budget
