"""Tokens evaluated to look ahead, then taken back out: one helper for every draft.

``undone(llm)`` evaluates whatever its body evaluates and then removes it again (cache, token count
and last logits as before, also when the body fails); ``draft(llm, k, ...)`` inside it drafts up
to k tokens greedily, each an observed single-token step. Every draft is one: the lookahead draft
after a prompt (``lookahead_scores``: the answer's first queries join the window's), the guide's
draft between the pieces of a long prompt, and the turn's draft that drives a recall.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import numpy as np

from .._loader import ensure_llama_cpp
from ..bindings import KVGeometry, geometry, set_last_logits, used_cells
from ..bindings.observe import Observation, WindowScores, head_slots

llama_cpp = ensure_llama_cpp()


def last_logits(llm) -> np.ndarray:
    """float32 [n_vocab]: the context's logits of its last token (a view of llama.cpp's buffer)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


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


@contextlib.contextmanager
def undone(llm):
    """What the body evaluates on ``llm`` is removed again on leaving (``restore_tail``); if the body
    fails, its own error is the one to see."""
    n = llm.n_tokens
    last = last_logits(llm).copy()
    try:
        yield
    except BaseException:
        restore_tail(llm, n, last, strict=False)
        raise
    restore_tail(llm, n, last)


@contextlib.contextmanager
def draft(llm, k: int, eval_tokens: Callable[[list[int]], None], handler: Callable[[WindowScores], None],
          queries_only: bool = False):
    """Up to ``k`` tokens drafted greedily from ``llm``'s last logits, each evaluated by ``eval_tokens`` (which
    must not evict) as one observed single-token step: ``handler(view)`` sees it inside llama_decode (its
    queries; with ``queries_only`` False its attention too). The draft stops before an end-of-generation
    token. Yields the drafted tokens; on leaving they are removed again (``undone``)."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    with undone(llm):
        drafted: list[int] = []
        lg = last_logits(llm)
        obs = Observation(llm, 1, handler=handler, keep_last=False, queries_only=queries_only).start()
        try:
            while len(drafted) < k:
                t = int(np.argmax(lg))
                if llama_cpp.llama_vocab_is_eog(vocab, t):
                    break
                eval_tokens([t])
                obs.raise_pending()
                drafted.append(t)
                if len(drafted) < k:
                    lg = last_logits(llm)
        finally:
            obs.stop()
        yield drafted


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
        mem = llm._ctx.memory
        lo, hi = llama_cpp.llama_memory_seq_pos_min(mem, 0), llama_cpp.llama_memory_seq_pos_max(mem, 0)
        free = min(free, g.kv_size - (hi - lo + 1) if hi >= 0 else g.kv_size)
    return max(free, 0)


def lookahead_scores(llm, scores: WindowScores, k: int, eval_tokens: Callable[[list[int]], None],
                     stats: dict | None = None, share: float = 0.0) -> WindowScores:
    """``scores`` (the window's, observed on ``llm``'s cache as it is now) mixed with the
    attention of up to ``k`` tokens drafted greedily from the last logits: with ``share`` 0
    each query one vote, (w x window + sum of the drafted) / (w + d); with ``share`` x in
    (0, 1], (1 - x) x window + x x the drafted tokens' mean.

    The window's queries (the prompt's last tokens) tell only in part where the answer will look;
    the draft runs while the cache still holds every token, and the eviction then runs on the mixed
    scores: the drafted tokens only decide what is kept. The draft stops before an end-of-generation
    token and where the cache has no room left (``draft_room``); with 0 drafted tokens ``scores`` is
    returned as it is. ``eval_tokens`` evaluates tokens on ``llm`` without evicting (a plain
    ``Llama.eval``). ``stats``, if given, gets "drafted": the tokens drafted, "asked": k, "room": the free cells
    (``draft_room``). Returns float64 scores
    [L, H, n_kv] with the window's cells and true positions."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"lookahead must be an integer >= 0, got {k!r}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0.0 <= share <= 1.0):
        raise ValueError(f"lookahead_share must be a number in [0, 1], got {share!r}")
    n, g = llm.n_tokens, geometry(llm)
    if n == 0 or scores.pos_last != g.pos_max:
        raise ValueError("lookahead needs the scores of the cache's last tokens (observe, then draft)")
    room = draft_room(llm, g)
    if stats is not None:
        stats.update(drafted=0, asked=k, room=room)
    k = min(k, room, len(llm.input_ids) - n)
    if k <= 0:
        return scores
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

    with draft(llm, k, eval_tokens, add) as drafted:
        pass
    if stats is not None:
        stats["drafted"] = len(drafted)
    if not drafted:
        return scores
    w, d = scores.window, len(drafted)
    mixed = (w * scores.scores + acc) / (w + d) if share == 0 else (1.0 - share) * scores.scores + (share / d) * acc
    # the window's own queries stay (a turn's recall reads them), the draft's join them (a reselect reads both)
    return dataclasses.replace(scores, scores=mixed,
                               draft_queries=np.stack(queries, 1) if len(queries) == d else None)
