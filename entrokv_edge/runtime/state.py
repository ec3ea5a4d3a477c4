"""A runtime's whole state in memory and back: llama.cpp's state of the compressed cache, the logical
tokens, the true-position table, the last logits, the freshest window scores, the settings and the
recall's store (``capture``); restored only into a runtime of the same model, cache size and types
(``apply``). session.py writes and reads such states as files."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..models import model_identity
from .._loader import ensure_llama_cpp
from ..bindings import EntroKVError, geometry, restore, set_last_logits, true_positions
from ..bindings.observe import WindowScores
from ..controller.config import EDGE_OPTIONS, OFF, EvictionConfig
from .eviction import EvictionController
from .session import EntroKVState, SessionError, mismatch

llama_cpp = ensure_llama_cpp()

SETTINGS = tuple(f.name for f in dataclasses.fields(EvictionConfig))     # every setting, one list


def _without_queries(ws: WindowScores | None) -> WindowScores | None:
    """Window scores as a saved state keeps them: without the window's queries, which only the turn's recall
    right after that window reads (a restored conversation's next turn observes its own)."""
    return ws if ws is None or (ws.queries is None and ws.draft_queries is None) else \
        dataclasses.replace(ws, queries=None, draft_queries=None)


def _scores_fit(ws: WindowScores, g, n_head: int, n: int) -> bool:
    """Window scores an eviction of this cache can use: [n_layers, n_head, n_kv] attention weights,
    the slots' true positions [n_slots, n_kv] and the eligible layers' ids, observed before n."""
    s, tp = np.asarray(ws.scores), np.asarray(ws.true_pos)
    return (s.ndim == 3 and s.shape[:2] == (g.n_layers, n_head) and tp.shape == (g.n_slots, s.shape[2])
            and np.array_equal(np.asarray(ws.layer_ids), [l.il for l in g.layers]) and ws.pos_last < n
            and int(tp.max(initial=-1)) < n and bool(np.isfinite(s).all()) and bool((s >= 0).all()))


def identity(rt) -> dict:
    """What a saved state must match: the model (GGUF header hash), the cache's size, layout
    and types, the vocabulary."""
    g = geometry(rt)
    return {"model": model_identity(rt.model_path), "model_name": rt.metadata.get("general.name", ""),
            "kv_cells": rt.kv_cells, "n_vocab": rt.n_vocab(),
            "geometry": [g.n_layers, g.n_slots, g.type_k, g.type_v, g.v_trans, g.is_iswa,
                         llama_cpp.llama_model_n_head(rt.model)]}


def capture(rt) -> EntroKVState:
    """The whole state of ``rt`` (an EntroKVLlama) in memory."""
    size = llama_cpp.llama_state_get_size(rt.ctx)
    buf = (llama_cpp.ctypes.c_uint8 * size)()
    n_bytes = llama_cpp.llama_state_get_data(rt.ctx, buf, size)
    g = geometry(rt)
    tp = true_positions(rt)[:, : g.n_compacted] if g.n_compacted else np.zeros((g.n_slots, 0), np.int32)
    last = llama_cpp.llama_get_logits_ith(rt.ctx, -1) if rt.n_tokens and not rt._requires_eval else None
    logits = np.ctypeslib.as_array(last, shape=(rt.n_vocab(),)).copy() if last else np.zeros(0, np.float32)
    return EntroKVState(
        input_ids=np.asarray(rt.input_ids[: rt.n_tokens], dtype=np.int32).copy(), n_tokens=rt.n_tokens,
        llama_state=llama_cpp.ctypes.string_at(buf, n_bytes), seed=int(rt._seed), logits=logits, true_pos=tp,
        window_scores=_without_queries(rt._window_scores),
        settings={k: getattr(rt.config, k) for k in SETTINGS},
        identity=identity(rt), recall=rt.recall.arrays() if rt.recall else {})


def check(rt, state) -> tuple[EvictionConfig, int]:
    """SessionError, before anything changes, if ``state`` cannot be loaded into ``rt``: not an EntroKVState,
    made for another model or cache, settings not valid here, arrays that cannot belong to this cache and
    model (logits, true positions, token ids: a token outside the vocabulary would crash llama.cpp later;
    window scores). Returns the state's settings and its logical length."""
    if not isinstance(state, EntroKVState):
        raise SessionError("not an EntroKVLlama state (a plain LlamaState lacks the true positions "
                           "of the compacted cells)")
    why = mismatch(state.identity, identity(rt))
    if why:
        raise SessionError(f"cannot load this state: {why}")
    try:   # options added after a state was saved did not exist then: off, not today's defaults
        cfg = EvictionConfig(**{**{k: OFF[k] for k in EDGE_OPTIONS}, "guide": 0, **state.settings})
    except (TypeError, ValueError) as e:
        raise SessionError(f"cannot load this state: its settings are not valid here ({e})") from None
    n = int(state.n_tokens)
    g = geometry(rt)
    ids = np.asarray(state.input_ids)[:n]
    tp = state.true_pos
    if state.logits.size not in (0, rt.n_vocab()) or tp.ndim != 2 or tp.shape[0] != g.n_slots or \
            tp.shape[1] > rt.kv_cells or n < 0 or ids.size != n or \
            (n and not 0 <= int(ids.min()) <= int(ids.max()) < rt.n_vocab()):
        raise SessionError("cannot load this state: its arrays do not fit this cache")
    ws = state.window_scores
    if ws is not None and not _scores_fit(ws, g, llama_cpp.llama_model_n_head(rt.model), n):
        raise SessionError("cannot load this state: its window scores do not fit this model and conversation")
    return cfg, n


def load(rt, state: EntroKVState, cfg: EvictionConfig, n: int) -> None:
    """Restore ``state`` into ``rt``, with what ``check`` found (its settings ``cfg``, its length ``n``); if
    llama.cpp still refuses it, the context is put back as it was before the call (SessionError)."""
    backup = capture(rt) if rt.n_tokens else None
    try:
        _apply(rt, state, n, cfg)
    except Exception as e:
        llama_cpp.llama_memory_clear(rt._ctx.memory, True)
        if backup is not None:
            _apply(rt, backup, backup.n_tokens, rt.config)
        else:
            rt.reset()
        if isinstance(e, (EntroKVError, SessionError)) or "refused" in str(e):
            raise SessionError(f"cannot load this state: {e}") from None
        raise


def _apply(rt, state: EntroKVState, n: int, cfg: EvictionConfig) -> None:
    raw = state.llama_state
    buf = (llama_cpp.ctypes.c_uint8 * len(raw)).from_buffer_copy(raw)
    if llama_cpp.llama_state_set_data(rt.ctx, buf, len(raw)) != len(raw):
        raise SessionError("llama.cpp refused the saved state")
    pos_max = geometry(rt).pos_max
    if pos_max != n - 1:
        raise SessionError(f"its cache holds positions up to {pos_max}, not the {n} tokens it names")
    rt.ensure_ids(n)
    rt.input_ids[:n] = state.input_ids[:n]
    rt.n_tokens = n
    rt._seed = state.seed
    if state.logits.size:
        set_last_logits(rt, state.logits)
    rt._requires_eval = state.logits.size == 0
    rt.controller = EvictionController(rt.controller.policy.with_config(cfg))   # a wrapped policy stays wrapped
    if state.true_pos.shape[1]:
        restore(rt, np.ascontiguousarray(state.true_pos, dtype=np.int32))
    rt._window_scores = state.window_scores
    if rt.recall:     # the store comes back with its cache (an instance without recall leaves it)
        try:
            rt.recall.load(rt, state.recall)
        except (KeyError, ValueError) as e:
            raise SessionError(str(e)) from None
