"""EntroKVLlama: a llama_cpp.Llama whose KV cache never overflows.

``n_ctx`` is the physical cache (the memory granted). Prompts longer than it are
evaluated in pieces, each piece's last ``window`` tokens observed, with an eviction
between pieces; after the prompt the cache is evicted down to the budget; during
generation it is evicted again whenever it fills. Positions continue across turns, so a
chat appends to the compressed cache; llama-cpp-python's prefix reuse cannot cut into
compacted cells (the native code refuses it), and an edited history is re-evaluated.

This class holds the state and the locks; the work is done in its rooms: reading.py (a prompt
read in pieces, the guide), eviction.py (the eviction step), recall/ (the recall at turns and
while decoding), state.py and session.py (saved states and session files), stats.py (counters).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from pathlib import Path
from typing import Callable

import numpy as np

from .._loader import ensure_llama_cpp
from ..bindings import geometry
from ..bindings.observe import Observation, WindowScores
from ..controller import EvictionConfig, Policy
from . import eviction, reading, session
from . import state as states
from .eviction import EvictionController, EvictionResult
from .events import Events
from .host import blas_threads, check_context_params, check_cache_types
from .recall import Recall, recall_config
from .rpc import add_servers
from .stats import RuntimeStats
from .store import Store

llama_cpp = ensure_llama_cpp()


class EntroKVLlama(llama_cpp.Llama):
    """Drop-in ``llama_cpp.Llama`` with Page-EntroKV eviction.

    Extra keyword arguments: the EvictionConfig settings (``budget``, ``page_size``,
    ``window``, ``sinks``, ``recent``, ``tau``, ``policy``, ``page_score``, and entrokv-edge's
    ``pool``, ``spread``, ``decay``, ``consensus``, ``entropy_region``, ``head_pool``,
    ``value_power``, ``lookahead``, ``lookahead_share``; ``guide``, ``guide_share``, ``guide_draft``) or
    ``eviction=`` an EvictionConfig, a Policy (controller/policies.py: one composed with a wrapper, say) or an
    EvictionController;
    ``recall`` (evicted tokens kept in a store, in a file or host memory, and brought back; default off:
    evictions are final; "turns": at later turns only, the store in a temporary file, recall/config.py's
    LATER_TURNS; True, a dict or a RecallConfig: the full tier, also while generating; docs/options.md, "Recall");
    ``logical_ctx`` (the longest conversation accepted, default: the model's training context); ``progress``
    (a callable(done, total) called during long prefills); ``rpc_servers`` ("host:port" or a list: llama.cpp
    RPC servers to offload to, with ``n_gpu_layers``; needs a ``-DGGML_RPC=ON`` build).
    """

    def __init__(self, model_path: str, *, eviction: EvictionConfig | Policy | EvictionController | None = None,
                 logical_ctx: int | None = None, progress: Callable[[int, int], None] | None = None,
                 rpc_servers=None, recall=None, **kwargs):
        settings = {k: kwargs.pop(k) for k in states.SETTINGS if k in kwargs}
        if eviction is not None and settings:
            raise TypeError("give either eviction=EvictionConfig(...) (or a Policy) or its settings, not both")
        if kwargs.get("logits_all"):
            raise ValueError("EntroKVLlama does not support logits_all (per-token logits of a logical "
                             "sequence longer than the cache)")
        if isinstance(eviction, EvictionController):
            controller = eviction
        else:
            controller = EvictionController(eviction if eviction is not None else EvictionConfig(**settings))
        cfg = controller.config
        recall_cfg = recall_config(recall)
        check_context_params(kwargs)
        check_cache_types(kwargs)
        if rpc_servers:
            add_servers(rpc_servers)
        super().__init__(model_path, **kwargs)
        self.controller = controller
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
        self.stats = RuntimeStats()
        self.events = Events()          # callbacks on what this instance does (runtime/events.py)
        self._aside: Store | None = None    # while a prompt is read in pieces without recall: what its evictions drop
        me = weakref.ref(self)          # no cycle through the recall: the model is freed when the instance goes
        self.recall = Recall(recall_cfg, lambda: me().controller.policy, self.stats, self.events) if recall_cfg \
            else None
        self._recall_obs: Observation | None = None     # window 1 over decoded tokens, while generating
        self._turn_scores: WindowScores | None = None    # a turn shorter than the window, observed for the recall

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

    @property
    def reserve(self) -> int:
        """Cells an eviction leaves free for new tokens (a quarter of the cache, at least a window and a page)."""
        return eviction.reserved_cells(self.kv_cells, self.config)

    def use(self, config: EvictionConfig | Policy | EvictionController) -> None:
        """Evict with other settings from now on (an EvictionConfig, a Policy or an EvictionController); the
        conversation and its cache stay as they are. ValueError for settings this cache cannot run (a window
        larger than a batch, protected pages beyond its room)."""
        with self._claim():
            controller = config if isinstance(config, EvictionController) else EvictionController(config)
            cfg = controller.config
            if cfg.window > self.n_batch or cfg.window > self.context_params.n_ubatch:
                raise ValueError(f"window {cfg.window} must fit one batch (n_batch {self.n_batch})")
            min_keep = (-(-cfg.sinks // cfg.page_size) + -(-cfg.rho // cfg.page_size) + 1) * cfg.page_size
            if self.kv_cells - eviction.reserved_cells(self.kv_cells, cfg) < min_keep:
                raise ValueError(f"a cache of {self.kv_cells} cells is too small for these settings")
            self.controller = controller

    def evict(self, n_keep: int | None = None) -> EvictionResult:
        """Evict now, with the freshest window scores, down to ``n_keep`` pages
        (default: the budget for the logical length, within the cache's capacity)."""
        with self._claim():
            return eviction.evict(self, n_keep)

    def ensure_ids(self, n: int) -> None:
        """Room for ``n`` logical tokens in ``input_ids``."""
        if n > len(self.input_ids):
            grown = np.zeros(max(n, 2 * len(self.input_ids)), dtype=self.input_ids.dtype)
            grown[: len(self.input_ids)] = self.input_ids
            self.input_ids = grown

    # --- evaluation -------------------------------------------------------------------

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
        tokens = [int(t) for t in tokens]
        with self._claim(), blas_threads(self.context_params.n_threads):
            self.events.emit("eval", rt=self, tokens=tokens)
            reading.read(self, tokens, guide)

    def _eval_plain(self, tokens: list[int]) -> None:
        """Evaluate tokens on the cache as it is, as a plain Llama does (no eviction, no recall): what the rooms
        use for pieces, guides, drafts and requeries (through the class's own ``super``, so a subclass between
        this class and llama_cpp.Llama sees every evaluation)."""
        super().eval(tokens)

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
        st = self.stats
        layers = [{"il": l.il, "bytes_full": self.n_tokens * (l.k_bytes_per_cell + l.v_bytes_per_cell),
                   "bytes_held": g.n_used * (l.k_bytes_per_cell + l.v_bytes_per_cell)} for l in g.layers]
        return {"logical_tokens": self.n_tokens, "kept_tokens": g.n_used, "kv_cells": g.kv_size,
                "kv_bytes_full": sum(x["bytes_full"] for x in layers),
                "kv_bytes_kept": sum(x["bytes_held"] for x in layers),
                "kv_bytes_allocated": g.kv_size * g.bytes_per_cell, "evictions": st.evictions,
                "eviction_s": st.eviction_s, "guided_evictions": st.guided, "guide_s": st.guide_s,
                "drafted_tokens": st.drafted, "reselected_tokens": st.reselected,
                "recall": self._recall_report(), "layers": layers}

    def _recall_report(self) -> dict:
        """What the recall tier holds and did: off, or the store's tokens per group buffer, its pages,
        bytes (K/V rows, digests), where it lives, and the recalls so far."""
        rc, st = self.recall, self.stats
        if rc is None:
            return {"on": False}
        store = rc.store
        nb = store.nbytes() if store is not None else {"rows": 0, "positions": 0, "digests": 0}
        return {"on": True, "every": rc.config.every, "pages": rc.config.pages,
                "where": f"file in {rc.config.directory}" if rc.config.directory else "memory",
                "store_tokens_per_group": store.n_tokens if store is not None else 0,
                "store_pages": store.n_pages() if store is not None else 0,
                "store_bytes": nb["rows"] + nb["positions"], "digest_bytes": nb["digests"],
                "store_bytes_in_memory": (0 if rc.config.directory else nb["rows"]) + nb["positions"],
                "store_mib": rc.config.store_mib, "dropped_tokens_per_group": rc.dropped,
                "recalls": st.recalls, "recalls_on_decode_attention": st.recalls_on_decode,
                "recalled_tokens": st.recalled, "recall_s": st.recall_s, "drafted_tokens": st.recall_drafted}

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

    def save_state(self) -> session.EntroKVState:
        """The whole state in memory: llama.cpp's state, the logical tokens, the true-position
        table, the last logits, the freshest window scores and the settings (what
        llama-cpp-python's caches keep between requests, and what ``save_session`` writes)."""
        with self._claim():
            return states.capture(self)

    def load_state(self, state: session.EntroKVState) -> None:
        """Restore a state from ``save_state`` (or ``session.read``). One made for another model,
        cache size or cache type raises ``SessionError`` before anything changes; if llama.cpp
        still refuses it, the context is put back as it was before the call."""
        cfg, n = states.check(self, state)
        with self._claim():
            states.load(self, state, cfg, n)
