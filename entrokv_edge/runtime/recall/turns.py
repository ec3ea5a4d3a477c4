"""The recall as the runtime drives it: at a new turn (its window's queries, evaluated again on the
recalled cache, then the answer's first tokens drafted) and while decoding (each decoded token
observed, a recall every ``every`` tokens). Functions of the runtime ``rt`` (an EntroKVLlama with
recall on); the recall's own decisions are in tier.py."""
from __future__ import annotations

import time
import weakref

import numpy as np

from ...bindings import geometry
from ...bindings.observe import Observation, WindowScores
from .. import eviction
from ..drafts import draft, draft_room, lookahead_scores


def timed(rt, fn, *args) -> int:
    """One recall (``Recall.step`` or ``Recall.turn``), counted and timed; the tokens it brought back."""
    t0 = time.perf_counter()
    n = fn(*args)
    rt.stats.recalls += 1
    rt.stats.recall_s += time.perf_counter() - t0
    return n


def at_turn(rt, ws: WindowScores) -> None:
    """A new turn, observed in ``ws`` (its window's queries, the last at the cache's last position): its queries
    bring back the pages they want; if that moved tokens, the window is evaluated again and recalls once more
    (``turn_requery``) and the turn's last token is evaluated again; then the answer's first tokens are drafted
    and drive a last recall (``turn_draft``)."""
    moved = timed(rt, rt.recall.turn, rt, ws.queries, ws.pos_last)
    if moved and rt.recall.config.turn_requery:
        again = requery(rt, ws.queries.shape[1])
        moved = moved if again is None else again
    if moved:       # the answer's first token must come from the cache as recalled
        t0 = time.perf_counter()
        refresh_last(rt)
        rt.stats.recall_s += time.perf_counter() - t0
    if rt.recall.config.turn_draft:
        turn_draft(rt)


def can_reselect(rt, start: int) -> bool:
    """Whether the turn read from ``start`` on can be reselected (``turn="reselect"``): a store with tokens,
    earlier than the turn, and a policy that reselects (entrokv-edge without value_power)."""
    cfg, rc = rt.config, rt.recall
    return (rc is not None and rc.config.turn == "reselect" and rc.store is not None and rc.store.n_tokens > 0
            and start >= rc.n_at_eviction and cfg.reselect and cfg.value_power == 0)


def reselect(rt, ws: WindowScores) -> None:
    """A new turn, observed in ``ws`` (its queries, the last at the cache's last position), in the mode
    ``turn="reselect"``, instead of the eviction after it: with ``turn_draft`` k > 0, the answer's first k tokens
    are drafted and their queries join the turn's (mixed as lookahead_share mixes a draft after a prompt); the
    turn's last token is taken out of the cache; an eviction chooses among the cache and the whole store by
    those queries; and the last token is evaluated again on the cache as chosen, so that the answer's first
    logits see what came back."""
    t0 = time.perf_counter()
    k = rt.recall.config.turn_draft
    if k:
        stats = {}
        rt.ensure_ids(rt.n_tokens + k)
        ws = lookahead_scores(rt, ws, k, rt._eval_plain, stats, rt.config.lookahead_share)
        rt.stats.recall_drafted += stats.get("drafted", 0)
    n = rt.n_tokens
    last = int(rt.input_ids[n - 1])
    if not rt._ctx.kv_cache_seq_rm(-1, n - 1, -1):
        raise RuntimeError("llama.cpp refused to take the turn's last token out for its reselect")
    rt.n_tokens = n - 1
    try:
        res = eviction.evict(rt, scores=ws)
        rt.stats.recalled += res.metrics.get("reselected_tokens", 0)
    finally:                            # the last token is evaluated again whatever happened to the eviction
        rt._eval_plain([last])
        rt.stats.recalls += 1
        rt.stats.recall_s += time.perf_counter() - t0


def turn_draft(rt) -> None:
    """After a turn's recall (option ``turn_draft`` k > 0): the answer's first k tokens drafted
    greedily, their queries (observed) driving a second recall, the draft removed again, and the
    turn's last token evaluated once more if that recall moved tokens."""
    t0 = time.perf_counter()
    n = rt.n_tokens
    k = min(rt.recall.config.turn_draft, draft_room(rt, geometry(rt)) - 1, rt._n_ctx - n)
    if k <= 0:
        rt.stats.recall_s += time.perf_counter() - t0
        return
    rt.ensure_ids(n + k)
    steps = []
    moved = 0
    with draft(rt, k, rt._eval_plain, lambda v: steps.append(v.queries[:, -1].copy()), queries_only=True):
        if steps:           # the recall sees the draft's cells too (causally, by true position)
            moved = rt.recall.turn(rt, np.stack(steps, 1), n + len(steps) - 1)
            rt.recall.hold(np.stack(steps, 1), n + len(steps) - 1)
            rt.stats.recalls += 1
            rt.stats.recall_drafted += len(steps)
    if moved:                                   # the draft has left; recalled pages stay
        refresh_last(rt)
    rt.stats.recall_s += time.perf_counter() - t0


def requery(rt, w: int) -> int | None:
    """After a turn's recall that moved tokens (option ``turn_requery``): the turn's last ``w`` tokens (its
    observed window, whose queries were computed on the cache before the recall) evaluated again on the
    cache as recalled, their new queries driving a second recall; the tokens that recall moved, or None
    when the window reaches into the compacted cells (a prompt that ends in its own eviction: nothing done)."""
    if w < 1 or rt.n_tokens - w < rt.recall.n_at_eviction:
        return None
    t0 = time.perf_counter()
    ws = eval_tail_again(rt, w, observe=True)
    rt.stats.recall_s += time.perf_counter() - t0
    if ws is None or ws.queries is None:    # not observed (a ubatch shorter than the window): no second recall
        return None
    return timed(rt, rt.recall.turn, rt, ws.queries, ws.pos_last)


def eval_tail_again(rt, w: int, observe: bool = False) -> WindowScores | None:
    """The last ``w`` tokens removed from the cache and evaluated again on it as it is now (a recall changed
    it); with ``observe``, their queries observed and returned. If that fails, the tokens are put back
    (unobserved) before the error goes on: no token of the turn is lost."""
    n = rt.n_tokens
    tail = [int(t) for t in rt.input_ids[n - w: n]]
    obs = Observation(rt, w, queries_only=True).start() if observe else None
    try:
        try:
            if not rt._ctx.kv_cache_seq_rm(-1, n - w, -1):
                raise RuntimeError("llama.cpp refused to remove the turn's last tokens for their re-evaluation")
            rt.n_tokens = n - w
            rt._eval_plain(tail)
        finally:
            if obs is not None:
                obs.stop()
    except BaseException:
        if rt.n_tokens < n:
            rt._ctx.kv_cache_seq_rm(-1, rt.n_tokens, -1)
            rt._eval_plain(tail[rt.n_tokens - (n - w):])
        raise
    return obs.last if obs is not None else None


def refresh_last(rt) -> None:
    """The last token evaluated again on the cache as it is now (a recall changed it): its keys, values
    and logits then follow the recalled pages. Not when the last eviction came after it (a prompt that
    ends in its own eviction): it is one of the compacted cells, and its logits saw the whole cache."""
    if rt.n_tokens > rt.recall.n_at_eviction:
        eval_tail_again(rt, 1)


def decode(rt, tokens: list[int]) -> None:
    """One decoded token, its queries observed; every ``every`` tokens, a recall."""
    rt.stats.evaluated += 1
    ws = rt._window_scores
    if ws is not None and ws.pos_last >= rt.n_tokens:
        rt._window_scores = None      # observed on tokens that are gone (a prefix reuse cut them)
    rt._ctx.kv_cache_seq_rm(-1, rt.n_tokens, -1)
    rt.ensure_ids(rt.n_tokens + 1)
    if rt._recall_obs is None:
        rt._recall_obs = Observation(rt, 1, handler=rt.recall.observe, keep_last=False, queries_only=True, rows=True)
        rt._recall_obs.llm = weakref.proxy(rt)      # it stays with the instance: no cycle back to it
    rt._recall_obs.start()
    rt._eval_plain(tokens)
    rt._recall_obs.raise_pending()
    if rt.recall.config.decode and rt.recall.due():
        timed(rt, rt.recall.step, rt)


def stop_observing(rt) -> None:
    """The decode observer off (a prompt or a turn is evaluated next)."""
    if rt._recall_obs is not None:
        rt._recall_obs.stop()
        rt._recall_obs = None
