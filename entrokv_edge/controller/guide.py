"""Guide: the end of a long prompt steers the evictions made before it is read.

A prompt longer than the cache is read in pieces, with an eviction between pieces. Each such
eviction is scored by its own piece's last window, which has not seen the question at the end
of the prompt yet, so a fact early in the document is evicted before anyone asks for it. But
the runtime holds the whole prompt before it reads the first piece. ``guide_scores`` evaluates
the prompt's end (the guide: the question or instruction and the chat template's assistant
header) right after the piece, with the attention of its tokens observed as one window, removes
the guide again (cache, token count and last logits as before), and mixes the guide's attention
on the cached keys into the piece's window scores. FINCH (Corallo & Papotti, TACL 2024) does
this chunk by chunk in transformers; here it runs per (layer, KV group) at the exact budget.

Optionally a short greedy draft follows the guide (``draft``): the answer's first queries, as
``lookahead`` drafts them after a prompt.
"""
from __future__ import annotations

import dataclasses

from typing import Callable

import numpy as np

from .._loader import ensure_llama_cpp
from ..bindings import geometry, used_cells
from ..bindings.observe import Observation, WindowScores, head_slots
from .lookahead import lookahead_scores, restore_tail


def guide_scores(llm, scores: WindowScores, guide: list[int], eval_tokens: Callable[[list[int]], None],
                 share: float, draft: int = 0, stats: dict | None = None, draft_share: float = 0.0) -> WindowScores:
    """``scores`` (the piece's window, observed on ``llm``'s cache as it is now) mixed with the
    attention of ``guide`` evaluated after it: (1 - share) x window + share x guide, the guide's
    attention normalized over the cells the window saw (its own tokens are gone afterwards).

    The guide is cut to its last tokens where the cache, a batch or a ubatch has less room
    (``stats["guided"]``: the tokens used, 0 when none fit; ``stats["drafted"]``: the draft's); with ``draft`` k > 0, up to k tokens
    are drafted greedily after it and their attention joins the guide's as a draft joins the window
    after a prompt: with ``draft_share`` 0 each drafted query counts as one of the guide's, with
    x in (0, 1] the draft's mean weighs x (the option lookahead_share). ``eval_tokens`` evaluates tokens on ``llm`` without evicting.
    On return the cache, token count and last logits are as before, also when evaluating fails."""
    llama_cpp = ensure_llama_cpp()
    n, g = llm.n_tokens, geometry(llm)
    if stats is not None:
        stats["guided"] = 0
    if n == 0 or scores.pos_last != g.pos_max:
        raise ValueError("the guide needs the scores of the cache's last tokens (observe a piece, then guide)")
    room = min(g.kv_size - used_cells(llm), llm.n_batch, llm.context_params.n_ubatch, len(llm.input_ids) - n)
    guide = [int(t) for t in guide][-room:] if room > 0 else []
    if not guide or share == 0:
        return scores
    last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
    try:
        with Observation(llm, len(guide)) as obs:
            eval_tokens(guide)
        seen = obs.last
        if draft:
            seen = lookahead_scores(llm, seen, draft, eval_tokens, stats, share=draft_share)
    except BaseException:
        restore_tail(llm, n, last, strict=False)      # the guide's own error is the one to see
        raise
    restore_tail(llm, n, last)
    n_w = scores.scores.shape[-1]
    v = np.asarray(seen.scores[:, :, :n_w], dtype=np.float64)
    moved = scores.true_pos != seen.true_pos[:, :n_w]               # (none: nothing changed in between)
    if moved.any():
        v = np.where(moved[head_slots(*v.shape[:2], scores.n_head_kv)], 0.0, v)
    total = v.sum(-1, keepdims=True)
    v = np.divide(v, total, out=np.zeros_like(v), where=total > 0)
    if stats is not None:
        stats["guided"] = len(guide)
    mixed = (1.0 - share) * np.asarray(scores.scores, dtype=np.float64) + share * v
    return dataclasses.replace(scores, scores=mixed)        # the window's own queries stay: a turn's recall reads them
