"""EntroKVLlama: a llama_cpp.Llama whose KV cache never overflows.

``n_ctx`` is the physical cache (the memory granted). Prompts longer than it are
evaluated in pieces, each piece's last ``window`` tokens observed, with an eviction
between pieces; after the prompt the cache is evicted down to the budget; during
generation it is evicted again whenever it fills. Positions continue across turns, so a
chat appends to the compressed cache; llama-cpp-python's prefix reuse cannot cut into
compacted cells (the native code refuses it), and an edited history is re-evaluated.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np

from ..bindings import EntroKVError, geometry, restore, set_last_logits, true_positions, used_cells
from ..bindings.observe import Observation, WindowScores, head_slots
from ..controller import EvictionConfig, EvictionResult, EvictionController
from ..controller.config import EDGE_OPTIONS, OFF
from ..controller.guide import guide_scores
from .._loader import ensure_llama_cpp
from . import session
from ..controller.lookahead import draft_room, restore_tail
from .recall import Recall, Store, new_store, recall_config, set_aside

llama_cpp = ensure_llama_cpp()

_SETTINGS = tuple(f.name for f in dataclasses.fields(EvictionConfig))     # every setting, one list


MAX_THREADS = 512          # ggml's GGML_MAX_N_THREADS: a larger thread count crashes inside ggml


def _load_malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim()


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``; nothing elsewhere).
    An eviction frees tens of MiB of short-lived arrays (scores, the rows it sets aside); glibc keeps
    freed memory of that size in the heap for reuse, in pieces that later allocations of other sizes do
    not fill, and the process's resident memory grows with every eviction of a long read. A few
    milliseconds; called after each eviction and after each piece of a prompt read in pieces (not after
    each decoded token)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _without_queries(ws: WindowScores | None) -> WindowScores | None:
    """Window scores as a saved state keeps them: without the window's queries, which only the turn's recall
    right after that window reads (a restored conversation's next turn observes its own)."""
    return ws if ws is None or (ws.queries is None and ws.draft_queries is None) else \
        dataclasses.replace(ws, queries=None, draft_queries=None)


def reserved_cells(kv_cells: int, cfg: EvictionConfig) -> int:
    """Cells an eviction leaves free for new tokens: a quarter of the cache, at least a window and a page."""
    return max(cfg.window + cfg.page_size, kv_cells // 4)


def cells_to_hold(n_tokens: int, cfg: EvictionConfig, step: int = 256) -> int:
    """The smallest cache, a multiple of ``step``, that holds ``n_tokens`` beside the cells an
    eviction leaves free."""
    cells = step
    while cells - reserved_cells(cells, cfg) < n_tokens:
        cells += step
    return cells


def _check_context_params(kwargs: dict) -> None:
    """Refuse what llama-cpp-python passes on unchecked and llama.cpp cannot take: more threads than
    ggml's maximum (a segfault), a cache size outside uint32 (silently truncated)."""
    for k in ("n_threads", "n_threads_batch"):
        v = kwargs.get(k)
        if v is not None and v > MAX_THREADS:
            raise ValueError(f"{k} must be at most {MAX_THREADS} (ggml's limit), got {v}")
    for k in ("n_ctx", "n_batch", "n_ubatch"):
        v = kwargs.get(k)
        if v is not None and not 0 <= v < 2**32:
            raise ValueError(f"{k} must be in 0..2^32-1, got {v}")


def _scores_fit(ws: WindowScores, g, n_head: int, n: int) -> bool:
    """Window scores an eviction of this cache can use: [n_layers, n_head, n_kv] attention weights,
    the slots' true positions [n_slots, n_kv] and the eligible layers' ids, observed before n."""
    s, tp = np.asarray(ws.scores), np.asarray(ws.true_pos)
    return (s.ndim == 3 and s.shape[:2] == (g.n_layers, n_head) and tp.shape == (g.n_slots, s.shape[2])
            and np.array_equal(np.asarray(ws.layer_ids), [l.il for l in g.layers]) and ws.pos_last < n
            and int(tp.max(initial=-1)) < n and bool(np.isfinite(s).all()) and bool((s >= 0).all()))


class EntroKVLlama(llama_cpp.Llama):
    """Drop-in ``llama_cpp.Llama`` with Page-EntroKV eviction.

    Extra keyword arguments: the EvictionConfig settings (``budget``, ``page_size``,
    ``window``, ``sinks``, ``recent``, ``tau``, ``policy``, ``page_score``, and entrokv-edge's
    ``pool``, ``spread``, ``decay``, ``consensus``, ``entropy_region``, ``head_pool``,
    ``value_power``, ``lookahead``, ``lookahead_share``; ``guide``, ``guide_share``, ``guide_draft``) or
    ``eviction=EvictionConfig(...)``; ``recall`` (True, or a dict / RecallConfig: evicted tokens are
    kept in a store, in host memory or a file, and brought back at new turns and while generating;
    runtime/recall.py, docs/options.md; default off); ``logical_ctx`` (the longest conversation accepted,
    default: the model's training context); ``progress`` (a callable(done, total) called
    during long prefills); ``rpc_servers`` ("host:port" or a list: llama.cpp RPC servers
    to offload to, with ``n_gpu_layers``; needs a ``-DGGML_RPC=ON`` build).
    """

    def __init__(self, model_path: str, *, eviction: EvictionConfig | None = None, logical_ctx: int | None = None,
                 progress: Callable[[int, int], None] | None = None, rpc_servers=None, recall=None, **kwargs):
        settings = {k: kwargs.pop(k) for k in _SETTINGS if k in kwargs}
        if eviction is not None and settings:
            raise TypeError("give either eviction=EvictionConfig(...) or its settings, not both")
        if kwargs.get("logits_all"):
            raise ValueError("EntroKVLlama does not support logits_all (per-token logits of a logical "
                             "sequence longer than the cache)")
        cfg = eviction if eviction is not None else EvictionConfig(**settings)
        recall_cfg = recall_config(recall)
        _check_context_params(kwargs)
        if rpc_servers:
            from .rpc import add_servers
            add_servers(rpc_servers)
        super().__init__(model_path, **kwargs)
        self.controller = EvictionController(cfg)
        g = geometry(self)          # raises EntroKVError for models the method cannot act on
        self.kv_cells = g.kv_size
        if cfg.window > self.n_batch or cfg.window > self.context_params.n_ubatch:
            raise ValueError(f"window {cfg.window} must fit one batch (n_batch {self.n_batch}, "
                             f"n_ubatch {self.context_params.n_ubatch})")
        n_swa = int(llama_cpp.llama_model_n_swa(self.model)) if g.is_iswa else 0
        if n_swa and self.kv_cells < n_swa + self.context_params.n_ubatch:
            # the sliding-window layers' cache has as many cells as the base cache and is only trimmed to the
            # window by us: it holds the window before a ubatch plus the ubatch itself, or llama_decode finds no slot
            self.close()
            raise ValueError(f"a cache of {self.kv_cells} cells cannot run this model's sliding-window layers: they "
                             f"keep the last {n_swa} tokens plus a ubatch ({self.context_params.n_ubatch}), so n_ctx "
                             f"must be >= {n_swa + self.context_params.n_ubatch}; give a larger n_ctx, or a smaller "
                             f"n_ubatch (and n_batch), at least the window ({cfg.window})")
        self.reserve = reserved_cells(self.kv_cells, cfg)
        min_keep = (-(-cfg.sinks // cfg.page_size) + -(-cfg.rho // cfg.page_size) + 1) * cfg.page_size
        if self.kv_cells - self.reserve < min_keep:
            raise ValueError(f"a cache of {self.kv_cells} cells is too small for these settings: it must hold "
                             f"the protected pages ({min_keep} tokens) plus room for new tokens ({self.reserve})")
        self._n_ctx = int(logical_ctx or llama_cpp.llama_model_n_ctx_train(self.model))
        self.progress = progress
        # one instance, one conversation: calls that touch the cache run one at a time (a second thread
        # waits), and while a generation is unfinished, a second one, or a cache call from another
        # thread, is refused (see generate and _claim)
        self._lock = threading.RLock()
        self._generating = threading.Lock()
        self._generator_thread: int | None = None
        self._window_scores: WindowScores | None = None
        self.last_eviction: EvictionResult | None = None
        self.n_evictions = 0
        self.n_evaluated = 0           # tokens given to eval since construction (the lookahead draft not counted)
        self.eviction_s = 0.0          # wall time spent in evictions (selection, compaction, lookahead's draft)
        self.n_guided = 0              # evictions between pieces of a prompt that its guide steered
        self.guide_s = 0.0             # wall time spent evaluating the guide (and its draft) for them
        self.n_drafted = 0             # tokens drafted to score evictions (lookahead's, the guide's), then removed
        self.n_reselected = 0          # set-aside tokens a reselect brought back (all (layer, KV group) buffers)
        self._aside: Store | None = None    # while a prompt is read in pieces without recall: what its evictions drop
        me = weakref.ref(self)          # no cycle through the recall: the model is freed when the instance goes
        self.recall = Recall(recall_cfg, lambda: me().config) if recall_cfg else None
        self._recall_obs: Observation | None = None     # window 1 over decoded tokens, while generating
        self._turn_scores: WindowScores | None = None    # a turn shorter than the window, observed for the recall
        self.recall_s = 0.0            # wall time spent in recalls (reading, scoring, swapping)

    def close(self) -> None:
        """Free the model and the cache: after any call in flight in another thread; refused
        (RuntimeError) while another thread's generation is unfinished, which would go on in
        freed memory."""
        if not hasattr(self, "_stack"):     # a constructor that refused its arguments never reached Llama.__init__
            return
        if not hasattr(self, "_lock"):      # refused by our constructor after Llama.__init__
            super().close()
            return
        with self._claim():
            super().close()
            if getattr(self, "recall", None):
                self.recall.reset()

    # --- the cache ------------------------------------------------------------------

    @property
    def config(self) -> EvictionConfig:
        return self.controller.config

    def _used(self) -> int:
        return used_cells(self)   # on every decoded token: the one-call form, not the full geometry

    def _capacity_pages(self) -> int:
        """Pages an eviction may keep so that new tokens still find room."""
        return (self.kv_cells - self.reserve) // self.config.page_size

    def _budget_pages(self, n: int) -> int:
        capacity = self._capacity_pages()
        try:    # no budget given: what the cache can keep with room for new tokens
            N = self.config.budget_pages(n, capacity * self.config.page_size)
        except ValueError:
            N = len(self.config.protected(n))
        return min(N, capacity)

    def evict(self, n_keep: int | None = None) -> EvictionResult:
        """Evict now, with the freshest window scores, down to ``n_keep`` pages
        (default: the budget for the logical length, within the cache's capacity)."""
        with self._claim():
            return self._evict(n_keep)

    def _evict(self, n_keep: int | None = None, controller: EvictionController | None = None,
               reselect: bool = False) -> EvictionResult:
        """``controller``: one with other settings for this eviction only (a guided eviction's consensus);
        ``reselect``: the eviction after a prompt read in pieces, which may choose what earlier ones set aside."""
        n = self.n_tokens
        if n == 0:
            raise ValueError("nothing to evict: the context is empty")
        scores = self._window_scores or self._recency_scores()
        N = self._budget_pages(n) if n_keep is None else n_keep
        if self.config.policy == "full":
            raise ValueError("the full policy never evicts: the cache is too small for this conversation")
        t0 = time.perf_counter()
        aside = (self.recall.store if self.recall else self._aside) if reselect else None  # recall's, or the read's own
        if self.recall:
            hook = lambda tp, cells: self.recall.on_evict(self, tp, cells)      # noqa: E731
        elif self._aside is not None and not reselect:      # (the read's own is dropped after its last eviction)
            hook = lambda tp, cells: set_aside(self, self._aside, tp, cells)    # noqa: E731
        else:
            hook = None
        res = (controller or self.controller).evict(self, scores, n_keep=N, before_compact=hook, aside=aside)
        self.n_reselected += res.metrics.get("reselected_tokens", 0)
        if self.recall:
            self.recall.n_keep = geometry(self).n_compacted
        release_freed_memory()
        self.eviction_s += time.perf_counter() - t0
        self.n_evictions += 1
        if res.metrics["kept_tokens"] > self.kv_cells - self.config.window:
            raise EntroKVError(-5, f"policy {self.config.policy} kept {res.metrics['kept_tokens']} tokens, "
                                   f"more than the cache ({self.kv_cells} cells) can hold with room to go on")
        self.last_eviction = res
        return res

    def _recency_scores(self) -> WindowScores:
        """Scores that favour recent tokens, for an eviction before any observation."""
        g = geometry(self)
        tp = true_positions(self)
        H = llama_cpp.llama_model_n_head(self.model)
        L, G = g.n_layers, g.layers[0].n_head_kv
        slot_of = head_slots(L, H, G)
        s = np.where(tp[slot_of] >= 0, tp[slot_of] + 1.0, 0.0).astype(np.float32)
        s /= s.sum(-1, keepdims=True)
        return WindowScores(s, tp, np.array([l.il for l in g.layers], np.int32), 0, 0, g.pos_max)

    # --- evaluation -------------------------------------------------------------------

    def _ensure_ids(self, n: int) -> None:
        if n > len(self.input_ids):
            grown = np.zeros(max(n, 2 * len(self.input_ids)), dtype=self.input_ids.dtype)
            grown[: len(self.input_ids)] = self.input_ids
            self.input_ids = grown

    def _eval_piece(self, piece: list[int], done: int, total: int) -> None:
        w = self.config.window
        head = piece if len(piece) < w else piece[:-w]
        if len(piece) < w and self.recall and self.recall.n_keep and len(piece) > 1:
            head = []                       # observed below
        for i in range(0, len(head), self.n_batch):   # batch by batch, for the progress report
            super().eval(head[i: i + self.n_batch])
            if self.progress is not None and total > 1:
                self.progress(done + min(i + self.n_batch, len(head)), total)
        if len(piece) >= w:
            with Observation(self, w) as obs:
                super().eval(piece[-w:])
            self._window_scores = obs.last
            if self.progress is not None and total > 1:
                self.progress(done + len(piece), total)
        elif self.recall and self.recall.n_keep and len(piece) > 1:
            # a turn shorter than the window: observed whole, for the recall its queries drive (not for evictions)
            with Observation(self, len(piece)) as obs:
                super().eval(piece)
            self._turn_scores = obs.last

    def generate(self, tokens, *args, **kwargs):
        """llama-cpp-python's generate, one at a time per instance: a generation started while
        another (from any thread) is still unfinished raises RuntimeError, since both would
        write into the same cache. Finish or close a stream before starting the next. Each step
        (up to the next token) holds the cache's lock; between steps, calls from other threads
        that touch the cache are refused (_claim) until the stream is exhausted or closed."""
        if not self._generating.acquire(blocking=False):
            raise RuntimeError("this EntroKVLlama is already generating (another stream is unfinished, maybe in "
                               "another thread): one instance holds one conversation at a time; finish or close "
                               "the other stream, or give each thread its own instance")
        inner = super().generate(tokens, *args, **kwargs)
        try:
            sent = None
            while True:
                with self._lock:
                    self._generator_thread = threading.get_ident()   # whichever thread resumes the stream
                    try:
                        token = inner.send(sent)
                    except StopIteration:
                        return
                sent = yield token
        finally:
            self._generator_thread = None
            inner.close()
            self._generating.release()

    @contextlib.contextmanager
    def _claim(self):
        """The cache's lock, for a call that touches the cache; RuntimeError if a generation is
        unfinished in another thread (its conversation would change under it)."""
        with self._lock:
            owner = self._generator_thread
            if owner is not None and owner != threading.get_ident():
                raise RuntimeError("this EntroKVLlama is generating in another thread (its stream is unfinished): "
                                   "one instance holds one conversation at a time; finish or close that stream, "
                                   "or give each thread its own instance")
            yield

    def eval(self, tokens, guide=None) -> None:
        """Evaluate ``tokens`` (a prompt, a turn, or decoded tokens), in pieces with evictions in between
        when they do not fit the cache. ``guide``: what steers those evictions (the option ``guide``):
        None, the last ``guide`` tokens of ``tokens`` (the question and the assistant header that end
        a prompt); else token ids or a text (for a caller that evaluates the document and the question
        in separate calls); [] or "": none."""
        with self._claim():
            self._eval(tokens, guide)

    def _guide_tokens(self, tokens: list[int], guide) -> list[int]:
        cfg = self.config
        if guide is None:
            guide = tokens[-cfg.guide:] if cfg.guide else []
        elif isinstance(guide, str):
            guide = self.tokenize(guide.encode(), add_bos=False, special=True)
        guide = [int(t) for t in guide]
        # after an eviction the cache has at least `reserve` free cells: a piece of a window or more, the guide
        # and its draft
        room = self.reserve - cfg.window - cfg.guide_draft
        return guide[max(len(guide) - room, 0):] if room > 0 else []

    def _evict_between(self, guide: list[int]) -> None:
        """An eviction between two pieces of a prompt: the guide's attention joins the last piece's
        window scores first (controller/guide.py), and a guided eviction keeps ``guide_consensus``."""
        ws, cfg = self._window_scores, self.config
        controller = None
        if guide and ws is not None and cfg.guide_share > 0 and cfg.policy not in ("streaming", "full") \
                and ws.pos_last == self.n_tokens - 1:
            t0, stats = time.perf_counter(), {}
            self._ensure_ids(self.n_tokens + len(guide) + cfg.guide_draft)
            self._window_scores = guide_scores(self, ws, guide, super().eval, cfg.guide_share, cfg.guide_draft, stats,
                                              cfg.lookahead_share)
            self.guide_s += time.perf_counter() - t0
            self.n_guided += stats["guided"] > 0
            self.n_drafted += stats.get("drafted", 0)
            if stats["guided"] and cfg.guide_consensus != cfg.consensus:
                controller = EvictionController(dataclasses.replace(cfg, consensus=cfg.guide_consensus))
        self._evict(controller=controller)

    def _eval(self, tokens, guide=None) -> None:
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        if self.recall:
            if self.n_tokens == 0:
                self.recall.reset()                 # a new conversation: the store was the last one's
            if len(tokens) == 1 and self.recall.n_keep and self.kv_cells - self._used() >= 1:
                self._decode_with_recall(tokens)
                return
            self._stop_recall_observer()
        self.n_evaluated += len(tokens)
        ws = self._window_scores
        if self.n_tokens == 0 or (ws is not None and ws.pos_last >= self.n_tokens):
            self._window_scores = None      # observed on tokens that are gone (a prefix reuse cut them)
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        self._ensure_ids(self.n_tokens + len(tokens))
        splits = len(tokens) > self.kv_cells - self._used()       # read in pieces, with evictions in between
        reselect = splits and self.config.reselect          # (an entrokv-edge option: a scored policy)
        if reselect and not self.recall:    # what the pieces' evictions drop, set aside in a file until the prompt is read
            try:    # rows only: a reselect reads no digests
                self._aside = new_store(geometry(self), self.config.page_size, tempfile.gettempdir(), digests=False)
            except (ValueError, OSError):   # layers of other K/V head sizes, no writable temporary directory:
                pass                        # the prompt is read without (the eviction after it as before)
        try:
            self._read_pieces(tokens, guide, splits, reselect)
        finally:
            if self._aside is not None:
                self._aside.close()
                self._aside = None

    def _read_pieces(self, tokens: list[int], guide, splits: bool, reselect: bool) -> None:
        w, total, done = self.config.window, len(tokens), 0
        guide = self._guide_tokens(tokens, guide) if splits else []
        g_room = len(guide) + (self.config.guide_draft if guide else 0)    # what the guide and its draft take
        tail = self.config.lookahead if splits and total >= w else 0        # the final eviction's draft
        while done < total:
            rest = total - done
            free = self.kv_cells - self._used()
            room = g_room if rest + tail > free else 0   # cells the guide needs before the next eviction
            if free - room < min(rest, w) or free <= 0 or (done and rest <= w and rest + tail > free):
                self._evict_between(guide)       # (the last: the final window and its draft then fit)
                free = self.kv_cells - self._used()
                room = g_room if rest + tail > free else 0
            piece = min(rest, free - room)
            if piece == rest and rest + tail > free and rest > w:
                piece = rest - w               # the last window after one more eviction, with room for the draft
            elif piece < rest and rest - piece < w <= rest:
                piece = rest - w               # leave the last window whole for the final piece
            if piece < rest and piece > self.n_batch:
                piece -= piece % self.n_batch  # whole batches, as llama-cpp-python decodes them
            self._eval_piece(tokens[done: done + piece], done, total)
            done += piece
            if splits:
                release_freed_memory()         # the piece's observation: its scores are freed
        if total >= w and self._used() > self._budget_pages(self.n_tokens) * self.config.page_size + self.config.page_size:
            if self.config.lookahead:           # the answer's first queries join the window's
                t0 = time.perf_counter()
                self._ensure_ids(self.n_tokens + self.config.lookahead)
                stats = {}
                self._window_scores = self.controller.draft_scores(self, self._window_scores, super().eval, stats)
                self.eviction_s += time.perf_counter() - t0
                self.n_drafted += stats.get("drafted", 0)
            reselected = self._evict(reselect=reselect).metrics["reselected"]    # after a prompt: down to the budget
        else:
            reselected = False
        # a new turn: its last queries bring back the pages they want (not after a reselect of the turn's own
        # eviction: its question has chosen among everything the store held)
        if self.recall and self.recall.n_keep and not reselected:
            ws = self._turn_scores or self._window_scores
            if ws is not None and ws.queries is not None and ws.pos_last == self.n_tokens - 1:
                self._turn_scores = None
                moved = self._timed_recall(self.recall.turn, self, ws.queries, ws.pos_last)
                if moved and self.recall.config.turn_requery:
                    again = self._requery(ws.queries.shape[1])
                    moved = moved if again is None else again
                if moved:       # the answer's first token must come from the cache as recalled
                    t0 = time.perf_counter()
                    self._refresh_last()
                    self.recall_s += time.perf_counter() - t0
                if self.recall.config.turn_draft:
                    self._turn_draft()
        self._turn_scores = None

    def _turn_draft(self) -> None:
        """After a turn's recall (option ``turn_draft`` k > 0): the answer's first k tokens drafted
        greedily, their queries (observed) driving a second recall, the draft removed again, and the
        turn's last token evaluated once more if that recall moved tokens."""
        t0 = time.perf_counter()
        n = self.n_tokens
        k = min(self.recall.config.turn_draft, draft_room(self, geometry(self)) - 1, self._n_ctx - n)
        if k <= 0:
            self.recall_s += time.perf_counter() - t0
            return
        self._ensure_ids(n + k)
        last = self._last_logits().copy()
        steps = []
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        obs = Observation(self, 1, handler=lambda v: steps.append(v.queries[:, -1].copy()), keep_last=False,
                          queries_only=True).start()
        moved = 0
        try:
            try:
                lg = last
                while len(steps) < k and not llama_cpp.llama_vocab_is_eog(vocab, int(np.argmax(lg))):
                    super().eval([int(np.argmax(lg))])
                    obs.raise_pending()
                    lg = self._last_logits()
            finally:
                obs.stop()
            if steps:           # the recall sees the draft's cells too (causally, by true position)
                moved = self.recall.turn(self, np.stack(steps, 1), n + len(steps) - 1)
                self.recall.hold(np.stack(steps, 1), n + len(steps) - 1)
                self.recall.n_recalls += 1
                self.recall.drafted += len(steps)
        except BaseException:
            restore_tail(self, n, last, strict=False)       # the draft's own error is the one to see
            raise
        restore_tail(self, n, last)                         # the draft leaves; recalled pages stay
        if moved:
            self._refresh_last()
        self.recall_s += time.perf_counter() - t0

    def _requery(self, w: int) -> int | None:
        """After a turn's recall that moved tokens (option ``turn_requery``): the turn's last ``w`` tokens (its
        observed window, whose queries were computed on the cache before the recall) evaluated again on the
        cache as recalled, their new queries driving a second recall; the tokens that recall moved, or None
        when the window reaches into the compacted cells (a prompt that ends in its own eviction: nothing done)."""
        if w < 1 or self.n_tokens - w < self.recall.n_at_eviction:
            return None
        t0 = time.perf_counter()
        ws = self._eval_tail_again(w, observe=True)
        self.recall_s += time.perf_counter() - t0
        if ws is None or ws.queries is None:    # not observed (a ubatch shorter than the window): no second recall
            return None
        return self._timed_recall(self.recall.turn, self, ws.queries, ws.pos_last)

    def _eval_tail_again(self, w: int, observe: bool = False) -> WindowScores | None:
        """The last ``w`` tokens removed from the cache and evaluated again on it as it is now (a recall changed
        it); with ``observe``, their queries observed and returned. If that fails, the tokens are put back
        (unobserved) before the error goes on: no token of the turn is lost."""
        n = self.n_tokens
        tail = [int(t) for t in self.input_ids[n - w: n]]
        obs = Observation(self, w, queries_only=True).start() if observe else None
        try:
            try:
                if not self._ctx.kv_cache_seq_rm(-1, n - w, -1):
                    raise RuntimeError("llama.cpp refused to remove the turn's last tokens for their re-evaluation")
                self.n_tokens = n - w
                super().eval(tail)
            finally:
                if obs is not None:
                    obs.stop()
        except BaseException:
            if self.n_tokens < n:
                self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
                super().eval(tail[self.n_tokens - (n - w):])
            raise
        return obs.last if obs is not None else None

    def _last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab(),))

    def _refresh_last(self) -> None:
        """The last token evaluated again on the cache as it is now (a recall changed it): its keys, values
        and logits then follow the recalled pages. Not when the last eviction came after it (a prompt that
        ends in its own eviction): it is one of the compacted cells, and its logits saw the whole cache."""
        if self.n_tokens > self.recall.n_at_eviction:
            self._eval_tail_again(1)

    def _decode_with_recall(self, tokens: list[int]) -> None:
        """One decoded token, its queries observed; every ``every`` tokens, a recall."""
        self.n_evaluated += 1
        ws = self._window_scores
        if ws is not None and ws.pos_last >= self.n_tokens:
            self._window_scores = None      # observed on tokens that are gone (a prefix reuse cut them)
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        self._ensure_ids(self.n_tokens + 1)
        if self._recall_obs is None:
            self._recall_obs = Observation(self, 1, handler=self.recall.observe, keep_last=False, queries_only=True,
                                           rows=True)
            self._recall_obs.llm = weakref.proxy(self)      # it stays with the instance: no cycle back to it
        self._recall_obs.start()
        super().eval(tokens)
        self._recall_obs.raise_pending()
        if self.recall.due():
            self._timed_recall(self.recall.step, self)

    def _timed_recall(self, fn, *args) -> int:
        """One recall (``Recall.step`` or ``Recall.turn``), counted and timed; the tokens it brought back."""
        t0 = time.perf_counter()
        n = fn(*args)
        self.recall.n_recalls += 1
        self.recall_s += time.perf_counter() - t0
        return n

    def _stop_recall_observer(self) -> None:
        if self._recall_obs is not None:
            self._recall_obs.stop()
            self._recall_obs = None

    def reset(self) -> None:
        with self._claim():
            super().reset()
            self._window_scores = None
            if self.recall:
                self.recall.reset()

    # --- reports and sessions -----------------------------------------------------------

    def kv_report(self) -> dict:
        """KV memory of a full cache for the logical length vs what the cache holds now, per layer;
        the evictions so far and the wall time they took (``eviction_s``)."""
        with self._lock:                # a consistent reading, between two steps of another thread's decoding
            g = geometry(self)
        layers = [{"il": l.il, "bytes_full": self.n_tokens * (l.k_bytes_per_cell + l.v_bytes_per_cell),
                   "bytes_held": g.n_used * (l.k_bytes_per_cell + l.v_bytes_per_cell)} for l in g.layers]
        return {"logical_tokens": self.n_tokens, "kept_tokens": g.n_used, "kv_cells": g.kv_size,
                "kv_bytes_full": sum(x["bytes_full"] for x in layers),
                "kv_bytes_kept": sum(x["bytes_held"] for x in layers),
                "kv_bytes_allocated": g.kv_size * g.bytes_per_cell, "evictions": self.n_evictions,
                "eviction_s": self.eviction_s, "guided_evictions": self.n_guided, "guide_s": self.guide_s,
                "drafted_tokens": self.n_drafted, "reselected_tokens": self.n_reselected,
                "recall": self._recall_report(), "layers": layers}

    def _recall_report(self) -> dict:
        """What the recall tier holds and did: off, or the store's tokens per group buffer, its pages,
        bytes (K/V rows, digests), where it lives, and the recalls so far."""
        rc = self.recall
        if rc is None:
            return {"on": False}
        st = rc.store
        nb = st.nbytes() if st is not None else {"rows": 0, "positions": 0, "digests": 0}
        return {"on": True, "every": rc.config.every, "pages": rc.config.pages,
                "where": f"file in {rc.config.directory}" if rc.config.directory else "memory",
                "store_tokens_per_group": st.n_tokens if st is not None else 0,
                "store_pages": st.n_pages() if st is not None else 0,
                "store_bytes": nb["rows"] + nb["positions"], "digest_bytes": nb["digests"],
                "store_bytes_in_memory": (0 if rc.config.directory else nb["rows"]) + nb["positions"],
                "recalls": rc.n_recalls, "recalls_on_decode_attention": rc.n_from_decode,
                "recalled_tokens": rc.recalled, "recall_s": self.recall_s,
                "drafted_tokens": rc.drafted}

    def save_session(self, path: str | Path, extra: dict | None = None) -> None:
        """Save the state (``save_state``) to ``path``, atomically, with checksums and the model's
        identity (runtime/session.py); ``extra`` (JSON-serializable) is saved with it."""
        state = self.save_state()
        state.extra = dict(extra or {})
        session.write(path, state)

    def load_session(self, path: str | Path) -> dict:
        """Restore a session saved by ``save_session``; returns the ``extra`` it was saved with.
        A file that is damaged or was saved with another model, cache size, cache type or
        version raises ``SessionError`` (a ValueError) and leaves the context as it was."""
        state = session.read(path)
        try:
            self.load_state(state)
        except session.SessionError as e:
            raise session.SessionError(f"{path}: {e}") from None
        return state.extra

    def _identity(self) -> dict:
        """What a saved state must match: the model (GGUF header hash), the cache's size, layout
        and types, the vocabulary."""
        from .. import models
        g = geometry(self)
        return {"model": models.model_identity(self.model_path), "model_name": self.metadata.get("general.name", ""),
                "kv_cells": self.kv_cells, "n_vocab": self.n_vocab(),
                "geometry": [g.n_layers, g.n_slots, g.type_k, g.type_v, g.v_trans, g.is_iswa,
                             llama_cpp.llama_model_n_head(self.model)]}

    def save_state(self) -> session.EntroKVState:
        """The whole state in memory: llama.cpp's state, the logical tokens, the true-position
        table, the last logits, the freshest window scores and the settings (what
        llama-cpp-python's caches keep between requests, and what ``save_session`` writes)."""
        with self._claim():
            size = llama_cpp.llama_state_get_size(self.ctx)
            buf = (llama_cpp.ctypes.c_uint8 * size)()
            n_bytes = llama_cpp.llama_state_get_data(self.ctx, buf, size)
            g = geometry(self)
            tp = true_positions(self)[:, : g.n_compacted] if g.n_compacted else np.zeros((g.n_slots, 0), np.int32)
            last = llama_cpp.llama_get_logits_ith(self.ctx, -1) if self.n_tokens and not self._requires_eval else None
            logits = np.ctypeslib.as_array(last, shape=(self.n_vocab(),)).copy() if last else np.zeros(0, np.float32)
            return session.EntroKVState(
                input_ids=np.asarray(self.input_ids[: self.n_tokens], dtype=np.int32).copy(), n_tokens=self.n_tokens,
                llama_state=llama_cpp.ctypes.string_at(buf, n_bytes), seed=int(self._seed), logits=logits, true_pos=tp,
                window_scores=_without_queries(self._window_scores),
                settings={k: getattr(self.config, k) for k in _SETTINGS},
                identity=self._identity(), recall=self.recall.arrays() if self.recall else {})

    def load_state(self, state: session.EntroKVState) -> None:
        """Restore a state from ``save_state`` (or ``session.read``). One made for another model,
        cache size or cache type raises ``SessionError`` before anything changes; if llama.cpp
        still refuses it, the context is put back as it was before the call."""
        if not isinstance(state, session.EntroKVState):
            raise session.SessionError("not an EntroKVLlama state (a plain LlamaState lacks the true positions "
                                       "of the compacted cells)")
        why = session.mismatch(state.identity, self._identity())
        if why:
            raise session.SessionError(f"cannot load this state: {why}")
        try:   # options added after a state was saved did not exist then: off, not today's defaults
            cfg = EvictionConfig(**{**{k: OFF[k] for k in EDGE_OPTIONS}, "guide": 0, **state.settings})
        except (TypeError, ValueError) as e:
            raise session.SessionError(f"cannot load this state: its settings are not valid here ({e})") from None
        n = int(state.n_tokens)
        self._refuse_unfit(state, n)
        with self._claim():
            backup = self.save_state() if self.n_tokens else None
            try:
                self._apply_state(state, n, cfg)
            except Exception as e:
                llama_cpp.llama_memory_clear(self._ctx.memory, True)
                if backup is not None:
                    self._apply_state(backup, backup.n_tokens, self.config)
                else:
                    self.reset()
                if isinstance(e, (EntroKVError, session.SessionError)) or "refused" in str(e):
                    raise session.SessionError(f"cannot load this state: {e}") from None
                raise

    def _refuse_unfit(self, state: session.EntroKVState, n: int) -> None:
        """SessionError, before anything changes, if the state's arrays cannot belong to this cache
        and model: logits, true positions, token ids (a token outside the vocabulary would crash
        llama.cpp later), window scores."""
        g = geometry(self)
        ids = np.asarray(state.input_ids)[:n]
        tp = state.true_pos
        if state.logits.size not in (0, self.n_vocab()) or tp.ndim != 2 or tp.shape[0] != g.n_slots or \
                tp.shape[1] > self.kv_cells or n < 0 or ids.size != n or \
                (n and not 0 <= int(ids.min()) <= int(ids.max()) < self.n_vocab()):
            raise session.SessionError("cannot load this state: its arrays do not fit this cache")
        ws = state.window_scores
        if ws is not None and not _scores_fit(ws, g, llama_cpp.llama_model_n_head(self.model), n):
            raise session.SessionError("cannot load this state: its window scores do not fit this model and "
                                       "conversation")

    def _apply_state(self, state: session.EntroKVState, n: int, cfg: EvictionConfig) -> None:
        raw = state.llama_state
        buf = (llama_cpp.ctypes.c_uint8 * len(raw)).from_buffer_copy(raw)
        if llama_cpp.llama_state_set_data(self.ctx, buf, len(raw)) != len(raw):
            raise session.SessionError("llama.cpp refused the saved state")
        pos_max = geometry(self).pos_max
        if pos_max != n - 1:
            raise session.SessionError(f"its cache holds positions up to {pos_max}, not the {n} tokens it names")
        self._ensure_ids(n)
        self.input_ids[:n] = state.input_ids[:n]
        self.n_tokens = n
        self._seed = state.seed
        if state.logits.size:
            set_last_logits(self, state.logits)
        self._requires_eval = state.logits.size == 0
        self.controller = EvictionController(cfg)
        if state.true_pos.shape[1]:
            restore(self, np.ascontiguousarray(state.true_pos, dtype=np.int32))
        self._window_scores = state.window_scores
        if self.recall:     # the store comes back with its cache (an instance without recall leaves it)
            try:
                self.recall.load(self, state.recall)
            except (KeyError, ValueError) as e:
                raise session.SessionError(str(e)) from None
