"""Observation-window scores from inside llama.cpp's graph, delivered through a cffi callback.

    with Observation(llm, window=32) as obs:
        llm.eval(prompt_tokens[-32:])        # a ubatch of >= 32 tokens is observed
    obs.last.scores   # float32 [L, H, n_kv]: mean attention of the window's queries on each cell

The callback runs inside llama_decode; the arrays it sees are zero-copy numpy views of
the native buffer (one device-to-host copy happened in the native code) and stay valid
only during the call, so ``Observation`` keeps a copy of the last one (``last``), and
calls ``handler(view)`` first if one is given.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .native import observed_arrays, observer_callback, set_observer


@dataclass
class WindowScores:
    """Scores of one observed ubatch.

    scores    [L, H, n_kv]: mean over the window queries of the attention on cell c (float32
              views inside the callback; float64 in copies, trimmed to the used cells)
    true_pos  int32   [n_slots, n_kv]: true position of each cell's token per (layer, KV head) slot
    layer_ids int32   [L]
    queries   float32 [L, window, H, head_dim] or None: the window's queries as attention sees
              them (RoPE applied, times the model's scale: q . k is the logit of a cached key k)
    draft_queries float32 [L, k, H, head_dim] or None: the queries of k tokens drafted right after the
              window (a lookahead draft, removed again), as ``queries``
    rows      float32 [L, H, n_rows] or None: the decode observer's rows, the model's own attention of the
              ubatch's last token over cells 0..n_rows-1 (``Observation(..., rows=True)``)
    """

    scores: np.ndarray
    true_pos: np.ndarray
    layer_ids: np.ndarray
    window: int
    n_tokens: int
    pos_last: int
    queries: np.ndarray | None = None
    draft_queries: np.ndarray | None = None
    rows: np.ndarray | None = None

    @property
    def n_head_kv(self) -> int:
        return self.true_pos.shape[0] // self.scores.shape[0]

    def copy(self) -> "WindowScores":
        """A copy that owns its data: scores as float64 (what the controller computes in;
        converting during the copy the callback must make anyway costs nothing more),
        trimmed after the last cell that holds a token."""
        used = np.flatnonzero((self.true_pos >= 0).any(axis=0))
        n = int(used[-1]) + 1 if used.size else 0
        return WindowScores(np.array(self.scores[:, :, :n], dtype=np.float64), self.true_pos[:, :n].copy(),
                            self.layer_ids.copy(), self.window, self.n_tokens, self.pos_last,
                            None if self.queries is None else self.queries.copy(),
                            None if self.draft_queries is None else self.draft_queries.copy(),
                            None if self.rows is None else self.rows.copy())


def head_slots(n_layers: int, n_head: int, n_head_kv: int) -> np.ndarray:
    """int [L, H]: the slot (a (layer, KV head) pair, layer-major) each query head reads."""
    return np.arange(n_layers)[:, None] * n_head_kv + np.arange(n_head)[None, :] // (n_head // n_head_kv)


def _view(s) -> WindowScores:
    scores, tpos, ids, q, rows = observed_arrays(s)
    return WindowScores(scores, tpos, ids, s.window, s.n_tokens, s.pos_last, q, rows=rows)


class Observation:
    """Observe every ubatch of >= ``window`` tokens decoded on ``llm`` while active.

    ``handler(view)``, if given, is called inside llama_decode with zero-copy views; it
    must not decode. ``last`` holds a copy of the last observed scores (unless
    ``keep_last=False``: a handler that reduces every view itself needs no copy). With
    ``queries_only`` no attention is computed: the views' scores and true_pos have 0 cells, and
    their queries are the window's. ``rows`` (the decode observer: queries only, window 1) also hands
    over the ubatch's last token's attention as the decode computed it (``view.rows``; None where it
    made none or its logits are not q . k: flash attention, attention sinks, a softcap, a bias, ALiBi).
    Use as a context manager, or call ``start()`` / ``stop()``.
    """

    def __init__(self, llm, window: int, handler: Callable[[WindowScores], None] | None = None,
                 keep_last: bool = True, queries_only: bool = False, rows: bool = False):
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < 2**31:
            raise ValueError(f"window must be an integer >= 1 (and within int32), got {window!r}")
        if rows and (window != 1 or not queries_only):
            raise ValueError("rows=True is the decode observer: window 1 and queries_only")
        self.llm, self.window, self.handler, self.keep_last = llm, window, handler, keep_last
        self.queries_only, self.rows = queries_only, rows
        self.last: WindowScores | None = None
        self.count = 0
        self._error: BaseException | None = None
        # the callback holds the observation weakly: a cycle (observation -> callback -> observation) would
        # keep every observation's scores alive until the garbage collector happened to run, MiBs each
        ref = weakref.ref(self)

        def on_scores(s):
            self = ref()
            if self is None:
                return
            try:
                view = _view(s)
                if self.handler is not None:
                    self.handler(view)
                if self.keep_last:
                    self.last = view.copy()
                self.count += 1
            except BaseException as e:  # noqa: BLE001 - re-raised after the decode returns
                self._error = e

        self._cb = observer_callback(on_scores)

    def start(self) -> "Observation":
        kind = "decode" if self.rows else "queries" if self.queries_only else "scores"
        set_observer(self.llm, kind, self.window, self._cb)
        return self

    def stop(self) -> None:
        set_observer(self.llm, "scores", 0, None)
        self.raise_pending()

    def raise_pending(self) -> None:
        """Re-raise an exception the handler raised inside llama_decode."""
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def __enter__(self) -> "Observation":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
