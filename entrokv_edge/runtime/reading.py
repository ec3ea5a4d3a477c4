"""Reading a prompt (or a turn) into the cache: in pieces when it does not fit, with an eviction between
pieces steered by the prompt's end (the guide), then the eviction after the prompt down to the budget
(scored with the lookahead draft; with reselect, choosing among every token the prompt held), then the
turn's recall. Functions of the runtime ``rt`` (an EntroKVLlama).

The guide: each eviction between pieces is scored by its own piece's last window, which has not seen
the question at the end of the prompt yet; but the runtime holds the whole prompt before it reads the
first piece. ``guide_scores`` evaluates the prompt's end (the question or instruction and the chat
template's assistant header) right after the piece, its tokens' attention observed as one window,
removes the guide again, and mixes its attention on the cached keys into the piece's window scores
(FINCH's prompt-guided compression, per (layer, KV group) at the exact budget). Optionally a short
greedy draft follows the guide.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Callable

import numpy as np

from ..bindings import geometry, used_cells
from ..bindings.observe import Observation, WindowScores, head_slots
from . import eviction
from .drafts import lookahead_scores, undone
from .host import release_freed_memory
from .recall import turns
from .store import new_store


def guide_scores(llm, scores: WindowScores, guide: list[int], eval_tokens: Callable[[list[int]], None],
                 share: float, draft: int = 0, stats: dict | None = None, draft_share: float = 0.0) -> WindowScores:
    """``scores`` (the piece's window, observed on ``llm``'s cache as it is now) mixed with the
    attention of ``guide`` evaluated after it: (1 - share) x window + share x guide, the guide's
    attention normalized over the cells the window saw (its own tokens are gone afterwards).

    The guide is cut to its last tokens where the cache, a batch or a ubatch has less room
    (``stats["guided"]``: the tokens used, 0 when none fit; ``stats["drafted"]``: the draft's); with ``draft``
    k > 0, up to k tokens are drafted greedily after it and their attention joins the guide's as a draft joins
    the window after a prompt: with ``draft_share`` 0 each drafted query counts as one of the guide's, with
    x in (0, 1] the draft's mean weighs x (the option lookahead_share). ``eval_tokens`` evaluates tokens on
    ``llm`` without evicting. On return the cache, token count and last logits are as before, also when
    evaluating fails."""
    n, g = llm.n_tokens, geometry(llm)
    if stats is not None:
        stats["guided"] = 0
    if n == 0 or scores.pos_last != g.pos_max:
        raise ValueError("the guide needs the scores of the cache's last tokens (observe a piece, then guide)")
    room = min(g.kv_size - used_cells(llm), llm.n_batch, llm.context_params.n_ubatch, len(llm.input_ids) - n)
    guide = [int(t) for t in guide][-room:] if room > 0 else []
    if not guide or share == 0:
        return scores
    with undone(llm):
        with Observation(llm, len(guide)) as obs:
            eval_tokens(guide)
        seen = obs.last
        if draft:
            seen = lookahead_scores(llm, seen, draft, eval_tokens, stats, share=draft_share)
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


def read(rt, tokens: list[int], guide=None) -> None:
    """Evaluate ``tokens`` (a prompt, a turn, or a decoded token) on ``rt``, in pieces with evictions in between
    when they do not fit its cache; ``guide`` as ``EntroKVLlama.eval`` takes it."""
    if not tokens:
        return
    if rt.recall:
        if rt.n_tokens == 0:
            rt.recall.reset()                 # a new conversation: the store was the last one's
        if len(tokens) == 1 and rt.recall.n_keep and rt.recall.config.decode and rt.kv_cells - used_cells(rt) >= 1:
            turns.decode(rt, tokens)
            return
        turns.stop_observing(rt)
    rt.stats.evaluated += len(tokens)
    ws = rt._window_scores
    if rt.n_tokens == 0 or (ws is not None and ws.pos_last >= rt.n_tokens):
        rt._window_scores = None      # observed on tokens that are gone (a prefix reuse cut them)
    rt._ctx.kv_cache_seq_rm(-1, rt.n_tokens, -1)
    rt.ensure_ids(rt.n_tokens + len(tokens))
    splits = len(tokens) > rt.kv_cells - used_cells(rt)       # read in pieces, with evictions in between
    if splits and rt.config.policy == "full":
        raise ValueError(eviction.full_refusal(rt, rt.n_tokens + len(tokens)))
    reselect = splits and rt.config.reselect          # (an entrokv-edge option: a scored policy)
    if reselect and not rt.recall:    # what the pieces' evictions drop, set aside in a file until the prompt is read
        try:    # rows only: a reselect reads no digests
            rt._aside = new_store(geometry(rt), rt.config.page_size, tempfile.gettempdir(), digests=False)
        except (ValueError, OSError):   # layers of other K/V head sizes, no writable temporary directory:
            pass                        # the prompt is read without (the eviction after it as before)
    later = bool(rt.recall and rt.recall.n_keep)      # a turn after an eviction: the store held tokens before it
    try:
        _read_pieces(rt, tokens, guide, splits, reselect, rt.n_tokens, later)
    finally:
        if rt._aside is not None:
            rt._aside.close()
            rt._aside = None


def guide_tokens(rt, tokens: list[int], guide) -> list[int]:
    """The guide of a prompt read in pieces: None, its last ``guide`` tokens; else token ids or a text; cut to
    what the cache has room for after an eviction (a piece of a window or more, the guide and its draft)."""
    cfg = rt.config
    if guide is None:
        guide = tokens[-cfg.guide:] if cfg.guide else []
    elif isinstance(guide, str):
        guide = rt.tokenize(guide.encode(), add_bos=False, special=True)
    guide = [int(t) for t in guide]
    room = rt.reserve - cfg.window - cfg.guide_draft
    return guide[max(len(guide) - room, 0):] if room > 0 else []


def _evict_between(rt, guide: list[int]) -> None:
    """An eviction between two pieces of a prompt: the guide's attention joins the last piece's
    window scores first, and a guided eviction keeps ``guide_consensus``."""
    ws, cfg = rt._window_scores, rt.config
    controller = None
    if guide and ws is not None and cfg.guide_share > 0 and cfg.policy not in ("streaming", "full") \
            and ws.pos_last == rt.n_tokens - 1:
        t0, stats = time.perf_counter(), {}
        rt.ensure_ids(rt.n_tokens + len(guide) + cfg.guide_draft)
        rt._window_scores = guide_scores(rt, ws, guide, rt._eval_plain, cfg.guide_share, cfg.guide_draft,
                                         stats, cfg.lookahead_share)
        rt.stats.guide_s += time.perf_counter() - t0
        rt.stats.guided += stats["guided"] > 0
        rt.stats.drafted += stats.get("drafted", 0)
        _drafted(rt, "guide", stats)
        if stats["guided"] and cfg.guide_consensus != cfg.consensus:
            controller = rt.controller.replace(consensus=cfg.guide_consensus)
    eviction.evict(rt, controller=controller)


def _drafted(rt, kind: str, stats: dict) -> None:
    if "asked" in stats:            # a draft ran (lookahead_scores was asked for one)
        rt.events.emit("drafted", rt=rt, kind=kind, k=stats["asked"], room=stats["room"], drafted=stats["drafted"])


def _eval_piece(rt, piece: list[int], done: int, total: int) -> None:
    w = rt.config.window
    head = piece if len(piece) < w else piece[:-w]
    if len(piece) < w and rt.recall and rt.recall.n_keep and len(piece) > 1:
        head = []                       # observed below
    for i in range(0, len(head), rt.n_batch):   # batch by batch, for the progress report
        rt._eval_plain(head[i: i + rt.n_batch])
        if rt.progress is not None and total > 1:
            rt.progress(done + min(i + rt.n_batch, len(head)), total)
    if len(piece) >= w:
        with Observation(rt, w) as obs:
            rt._eval_plain(piece[-w:])
        rt._window_scores = obs.last
        if rt.progress is not None and total > 1:
            rt.progress(done + len(piece), total)
    elif rt.recall and rt.recall.n_keep and len(piece) > 1:
        # a turn shorter than the window: observed whole, for the recall its queries drive (not for evictions)
        with Observation(rt, len(piece)) as obs:
            rt._eval_plain(piece)
        rt._turn_scores = obs.last


def _read_pieces(rt, tokens: list[int], guide, splits: bool, reselect: bool, start: int, later: bool) -> None:
    w, total, done = rt.config.window, len(tokens), 0
    guide = guide_tokens(rt, tokens, guide) if splits else []
    g_room = len(guide) + (rt.config.guide_draft if guide else 0)    # what the guide and its draft take
    tail = rt.config.lookahead if splits and total >= w else 0        # the final eviction's draft
    while done < total:
        rest = total - done
        free = rt.kv_cells - used_cells(rt)
        room = g_room if rest + tail > free else 0   # cells the guide needs before the next eviction
        if free - room < min(rest, w) or free <= 0 or (done and rest <= w and rest + tail > free):
            _evict_between(rt, guide)            # (the last: the final window and its draft then fit)
            free = rt.kv_cells - used_cells(rt)
            room = g_room if rest + tail > free else 0
        piece = min(rest, free - room)
        if piece == rest and rest + tail > free and rest > w:
            piece = rest - w               # the last window after one more eviction, with room for the draft
        elif piece < rest and rest - piece < w <= rest:
            piece = rest - w               # leave the last window whole for the final piece
        if piece < rest and piece > rt.n_batch:
            piece -= piece % rt.n_batch    # whole batches, as llama-cpp-python decodes them
        _eval_piece(rt, tokens[done: done + piece], done, total)
        done += piece
        if splits:
            release_freed_memory()         # the piece's observation: its scores are freed
    P = rt.config.page_size
    if not splits and turns.can_reselect(rt, start):      # a later turn, with a store to choose from
        ws = rt._turn_scores or rt._window_scores
        rt._turn_scores = None
        if ws is not None and ws.queries is not None and ws.pos_last == rt.n_tokens - 1:
            turns.reselect(rt, ws)
            return
    if total >= w and rt.config.policy != "full" and used_cells(rt) > eviction.budget_pages(rt, rt.n_tokens) * P + P:
        if rt.config.lookahead:           # the answer's first queries join the window's
            t0 = time.perf_counter()
            rt.ensure_ids(rt.n_tokens + rt.config.lookahead)
            stats = {}
            rt._window_scores = rt.controller.draft_scores(rt, rt._window_scores, rt._eval_plain, stats)
            rt.stats.eviction_s += time.perf_counter() - t0
            rt.stats.drafted += stats.get("drafted", 0)
            _drafted(rt, "lookahead", stats)
        reselected = eviction.evict(rt, reselect=reselect).metrics["reselected"]    # after a prompt: to the budget
    else:
        reselected = False
    # a new turn: its last queries bring back the pages they want (not after a reselect of the turn's own
    # eviction: its question has chosen among everything the store held; after the first prompt's own
    # eviction only with first_turn)
    if rt.recall and rt.recall.n_keep and not reselected and (later or rt.recall.config.first_turn):
        ws = rt._turn_scores or rt._window_scores
        if ws is not None and ws.queries is not None and ws.pos_last == rt.n_tokens - 1:
            rt._turn_scores = None
            if rt.recall.config.turn == "recall":
                turns.at_turn(rt, ws)
    rt._turn_scores = None
