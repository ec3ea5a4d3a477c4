"""Lookahead: the answer's first queries, drafted with the whole cache, join the window's.

The window's queries (the prompt's last tokens) tell only in part where the answer will
look. Before the eviction after a prompt, ``lookahead_scores`` drafts up to ``k`` tokens
greedily while the cache still holds every token, observes each drafted token's attention
(one observed single-token step each), then removes the drafted tokens again (cache, token
count and last logits as before the draft, also when the draft fails), and returns the
window's scores mixed with the drafted queries' scores: each query one vote, or with a given
share for the draft (the option lookahead_share). The
eviction then runs on the mixed scores, and the answer is generated from the evicted cache
as without lookahead: the drafted tokens only decide what is kept.
"""
from __future__ import annotations

import dataclasses

from typing import Callable

import numpy as np

from .._loader import ensure_llama_cpp
from ..bindings import KVGeometry, geometry, set_last_logits, used_cells
from ..bindings.observe import Observation, WindowScores, head_slots


def lookahead_scores(llm, scores: WindowScores, k: int, eval_tokens: Callable[[list[int]], None],
                     stats: dict | None = None, share: float = 0.0) -> WindowScores:
    """``scores`` (the window's, observed on ``llm``'s cache as it is now) mixed with the
    attention of up to ``k`` tokens drafted greedily from the last logits: with ``share`` 0
    each query one vote, (w x window + sum of the drafted) / (w + d); with ``share`` x in
    (0, 1], (1 - x) x window + x x the drafted tokens' mean.

    The draft stops before an end-of-generation token and where the cache has no room left
    (``draft_room``); with 0 drafted tokens ``scores`` is returned as it is. ``eval_tokens``
    evaluates tokens on ``llm`` without evicting (a plain ``Llama.eval``). ``stats``, if
    given, gets "drafted": the tokens drafted. Returns float64 scores [L, H, n_kv] with the
    window's cells and true positions."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"lookahead must be an integer >= 0, got {k!r}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0.0 <= share <= 1.0):
        raise ValueError(f"lookahead_share must be a number in [0, 1], got {share!r}")
    llama_cpp = ensure_llama_cpp()
    n, n_vocab, g = llm.n_tokens, llm.n_vocab(), geometry(llm)
    if n == 0 or scores.pos_last != g.pos_max:
        raise ValueError("lookahead needs the scores of the cache's last tokens (observe, then draft)")
    k = min(k, draft_room(llm, g), len(llm.input_ids) - n)
    if stats is not None:
        stats["drafted"] = 0
    if k <= 0:
        return scores
    last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).copy()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    L, H, n_w = scores.scores.shape
    slot_of = head_slots(L, H, scores.n_head_kv)                                  # [L, H]
    held = scores.true_pos >= 0                                                  # [n_slots, n_w]
    acc = np.zeros((L, H, n_w), dtype=np.float64)
    queries = []

    def add(view: WindowScores) -> None:
        # the drafted token's attention on the cells that still hold what the window saw
        # (on a fresh cache all of them: the drafted tokens sit after the window's cells)
        other = ~held | (view.true_pos[:, :n_w] != scores.true_pos)
        v = view.scores[:, :, :n_w]
        acc[...] += np.where(other[slot_of], 0.0, v) if other.any() else v
        if view.queries is not None:
            queries.append(np.array(view.queries[:, -1]))       # [L, H, d]: a reselect scores with it

    drafted, lg = [], last
    obs = Observation(llm, 1, handler=add, keep_last=False).start()
    try:   # each drafted token is one observed single-token step
        try:
            while len(drafted) < k:
                t = int(np.argmax(lg))
                if llama_cpp.llama_vocab_is_eog(vocab, t):
                    break
                eval_tokens([t])
                obs.raise_pending()
                drafted.append(t)
                if len(drafted) < k:
                    lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        finally:
            obs.stop()
    except BaseException:
        restore_tail(llm, n, last, strict=False)      # the draft's own error is the one to see
        raise
    restore_tail(llm, n, last)
    if stats is not None:
        stats["drafted"] = len(drafted)
    if not drafted:
        return scores
    w, d = scores.window, len(drafted)
    mixed = (w * scores.scores + acc) / (w + d) if share == 0 else (1.0 - share) * scores.scores + (share / d) * acc
    # the window's own queries stay (a turn's recall reads them), the draft's join them (a reselect reads both)
    return dataclasses.replace(scores, scores=mixed,
                               draft_queries=np.stack(queries, 1) if len(queries) == d else None)


def draft_room(llm, g: KVGeometry) -> int:
    """Tokens a draft may add: the cache's free cells; on models with sliding-window layers
    (iSWA) also the free cells of their cache, which is as large as the other with
    ``swa_full`` (llama-cpp-python's default) and else unknown here (no draft): a full
    sliding-window cache makes room by reusing cells its window has passed, and for the
    drafted tokens those include keys the answer's first token still sees."""
    free = g.kv_size - used_cells(llm)
    if g.is_iswa:
        if not llm.context_params.swa_full:
            return 0
        llama_cpp = ensure_llama_cpp()
        mem = llm._ctx.memory
        lo, hi = llama_cpp.llama_memory_seq_pos_min(mem, 0), llama_cpp.llama_memory_seq_pos_max(mem, 0)
        free = min(free, g.kv_size - (hi - lo + 1) if hi >= 0 else g.kv_size)
    return max(free, 0)


def restore_tail(llm, n: int, last: np.ndarray, strict: bool = True) -> None:
    """Undo tokens evaluated after the first ``n`` (a draft, or a probe of the cache): they
    leave the cache, the token count is ``n`` again and ``last`` [n_vocab] the last logits.
    ``strict``: raise if llama.cpp refuses to remove them (False: while another error is
    on its way)."""
    set_last_logits(llm, last)
    ok = llm._ctx.kv_cache_seq_rm(-1, n, -1)
    llm.n_tokens = n
    if strict and not ok:
        raise RuntimeError("llama.cpp refused to remove the drafted tokens")
