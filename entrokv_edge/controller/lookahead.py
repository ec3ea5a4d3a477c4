"""Lookahead: the answer's first queries, drafted with the whole cache, join the window's.

The window's queries (the prompt's last tokens) tell only in part where the answer will
look. Before the eviction after a prompt, ``lookahead_scores`` drafts up to ``k`` tokens
greedily while the cache still holds every token, observes each drafted token's attention
(one observed single-token step each), then removes the drafted tokens again (cache, token
count and last logits as before the draft), and returns the window's scores averaged with
the drafted queries' scores, each query one vote. The eviction and all that follows it then
run as without lookahead: the drafted tokens only decide what is kept.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .._loader import ensure_llama_cpp
from ..bindings import geometry, set_last_logits, used_cells
from ..bindings.observe import Observation, WindowScores


def lookahead_scores(llm, scores: WindowScores, k: int, eval_tokens: Callable[[list[int]], None]) -> WindowScores:
    """``scores`` (the window's, observed on ``llm``'s cache as it is now) averaged with the
    attention of up to ``k`` tokens drafted greedily from the last logits.

    The draft stops before an end-of-generation token and when the cache has no free cell
    left (0 drafted tokens: ``scores`` is returned as it is). ``eval_tokens`` evaluates
    tokens on ``llm`` without evicting (a plain ``Llama.eval``). Returns float64 scores
    [L, H, n_kv] with the window's cells and true positions."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"lookahead must be an integer >= 0, got {k!r}")
    llama_cpp = ensure_llama_cpp()
    n, n_vocab, g = llm.n_tokens, llm.n_vocab(), geometry(llm)
    if n == 0 or scores.pos_last != g.pos_max:
        raise ValueError("lookahead needs the scores of the cache's last tokens (observe, then draft)")
    k = min(k, g.kv_size - used_cells(llm))          # room in the cache
    if k <= 0:
        return scores
    last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).copy()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    L, H, n_w = scores.scores.shape
    G = scores.n_head_kv
    slot_of = np.arange(L)[:, None] * G + np.arange(H)[None, :] // (H // G)      # [L, H]
    held = scores.true_pos >= 0                                                  # [n_slots, n_w]
    acc = np.zeros((L, H, n_w), dtype=np.float64)

    def add(view: WindowScores) -> None:
        # the drafted token's attention on the cells that still hold what the window saw
        # (on a fresh cache all of them: the drafted tokens sit after the window's cells)
        other = ~held | (view.true_pos[:, :n_w] != scores.true_pos)
        v = view.scores[:, :, :n_w]
        acc[...] += np.where(other[slot_of], 0.0, v) if other.any() else v

    drafted, lg = [], last
    try:   # each drafted token is one observed single-token step
        with Observation(llm, 1, handler=add, keep_last=False):
            while len(drafted) < k:
                t = int(np.argmax(lg))
                if llama_cpp.llama_vocab_is_eog(vocab, t):
                    break
                eval_tokens([t])
                drafted.append(t)
                if len(drafted) < k:
                    lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
    finally:   # the cache, the token count and the last logits as before the draft
        _remove_after(llm, n)
        set_last_logits(llm, last)
    if not drafted:
        return scores
    w = scores.window
    mixed = (w * scores.scores + acc) / (w + len(drafted))
    return WindowScores(mixed, scores.true_pos, scores.layer_ids, scores.window, scores.n_tokens, scores.pos_last)


def _remove_after(llm, n: int) -> None:
    """Remove the tokens after the first n from the cache and from llm's token count."""
    if not llm._ctx.kv_cache_seq_rm(-1, n, -1):
        raise RuntimeError("llama.cpp refused to remove the drafted tokens")
    llm.n_tokens = n
