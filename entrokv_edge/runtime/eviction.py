"""The eviction step: window scores in, a compacted cache out.

``EvictionController`` acts on any ``llama_cpp.Llama`` (after ``import entrokv_edge``): it maps the
window scores from cells to true positions per (layer, KV head), asks its policy (controller/,
numpy only) for the pages every group buffer keeps, and compacts the cache. ``evict`` below is
the runtime's step: the budget its cache allows, the store an eviction hands its tokens to, the
counters.

    ctl = EvictionController(budget=0.2, page_size=16, window=32)
    result = ctl.prefill(llm, tokens)       # llm: a llama_cpp.Llama (after import entrokv_edge)
    result.metrics["uor_mean"], result.to_json()
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from ..bindings import EntroKVError, compact, geometry, swa_trim, true_positions, value_norms
from ..bindings.observe import Observation, WindowScores, head_slots
from ..controller import metrics as M
from ..controller.config import EvictionConfig
from ..controller.pages import page_scores, pages_to_positions
from ..controller.policies import Policy, Selection, policy_for
from ..controller.weights import head_weights
from .._loader import ensure_llama_cpp
from .drafts import lookahead_scores
from .host import release_freed_memory
from .reselect import UnionScores, resident, swap_in
from .store import set_aside

llama_cpp = ensure_llama_cpp()


@dataclass
class EvictionResult:
    """What one eviction kept, and its metrics (``metrics`` is JSON-ready)."""

    selection: Selection
    positions: np.ndarray          # int32 [L, G, K]: true positions kept per (layer, group)
    metrics: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.metrics)


class EvictionController:
    """Evicts a llama_cpp.Llama's cache with a policy: an EvictionConfig (its policy by name, ``policy_for``), a
    Policy (controller/policies.py: a wrapped one, say) or the settings of an EvictionConfig."""

    def __init__(self, config: EvictionConfig | Policy | None = None, *, swap_rows: int = 16384, **settings):
        """``swap_rows``: the set-aside tokens a reselect writes back per step (their rows in flight stay a few
        MiB whatever the prompt's length)."""
        if config is not None and settings:
            raise TypeError("give either an EvictionConfig (or a Policy) or keyword settings, not both")
        if isinstance(config, Policy):
            self.policy = config
        else:
            self.policy = policy_for(config if config is not None else EvictionConfig(**settings))
        self.swap_rows = swap_rows

    def replace(self, **changes) -> "EvictionController":
        """This controller with other settings (its policy's ``replace``)."""
        return EvictionController(self.policy.replace(**changes), swap_rows=self.swap_rows)

    @property
    def config(self) -> EvictionConfig:
        return self.policy.config

    def prefill(self, llm, tokens, *, needles=None) -> EvictionResult:
        """Evaluate ``tokens`` on a fresh context, its last ``window`` tokens as one
        observed ubatch (with ``lookahead``: then the draft's tokens, removed again), then
        evict. Bad settings raise before anything is evaluated."""
        cfg, tokens = self.config, [int(t) for t in tokens]
        n = len(tokens)
        if n == 0:
            raise ValueError("empty prompt")
        cfg.budget_pages(n)  # validates window and budget against this prompt
        g = geometry(llm)
        if g.n_used or getattr(llm, "n_tokens", 0):
            raise ValueError("prefill needs an empty context (call llm.reset() and clear the cache first)")
        if n > g.kv_size:
            raise ValueError(f"the prompt ({n} tokens) does not fit the cache ({g.kv_size} cells)")
        if n > cfg.window:
            llm.eval(tokens[: n - cfg.window])
        with Observation(llm, cfg.window) as obs:
            llm.eval(tokens[n - cfg.window:])
        return self.evict(llm, self.draft_scores(llm, obs.last, llm.eval), needles=needles)

    def draft_scores(self, llm, scores: WindowScores, eval_tokens, stats: dict | None = None) -> WindowScores:
        """``scores`` mixed with a draft's (the option lookahead; runtime/drafts.py), or
        ``scores`` as they are when it is off. ``eval_tokens``: evaluates tokens on ``llm``
        without evicting."""
        if not self.config.lookahead:
            return scores
        return lookahead_scores(llm, scores, self.config.lookahead, eval_tokens, stats, self.config.lookahead_share)

    def evict(self, llm, scores: WindowScores, *, needles=None, n_keep: int | None = None,
              before_compact=None, aside=None, ahead: bool = False) -> EvictionResult:
        """Select with the configured policy from ``scores`` and compact ``llm``'s cache.

        The cache may have been evicted before and may hold tokens decoded after the
        observation: scores are mapped from cells to true positions per (layer, KV head),
        every group chooses among the pages it still holds, and positions that came
        after the observed window (no score yet) get their head's mean score.
        ``n_keep``: pages to keep instead of the budget's (the runtime's capacity limit);
        ``before_compact(tp_now, cells)``: called with the slots' true positions (None: cells are
        positions) and the cells [n_slots, K] each keeps, right before the compaction.
        ``aside``: a store (runtime/store.py) of the tokens earlier evictions dropped: with the option
        ``reselect`` and the window's queries in ``scores``, they are scored with the cached ones and may be
        chosen; those chosen come back into the cache, the tokens they displace take their place in the
        store (runtime/reselect.py; metrics["reselected_tokens"]). ``ahead``: the queries in ``scores`` are
        those of tokens read after the cache and taken out again (a turn, read again after this eviction): the
        cache and ``aside`` are scored by them alone (ValueError where they cannot be: no store, no queries,
        a policy without reselect)."""
        cfg = self.config
        t0 = time.perf_counter()
        g = geometry(llm)
        n = g.pos_max + 1
        if n <= 0 or (scores.pos_last > g.pos_max and not ahead):
            raise ValueError("the scores do not belong to this cache (observed past its last position)")
        if ahead and not (cfg.reselect and aside is not None and aside.n_tokens and scores.queries is not None
                          and cfg.value_power == 0 and scores.pos_last > g.pos_max):
            raise ValueError("an eviction ahead of its queries needs a reselecting policy, a store and queries "
                             "observed after the cache")
        L, H = scores.scores.shape[:2]
        G = g.layers[0].n_head_kv
        r = H // G
        union = None
        if cfg.reselect and aside is not None and aside.n_tokens and scores.queries is not None \
                and cfg.value_power == 0 and (scores.pos_last == g.pos_max or ahead):     # the set-aside tokens too
            fresh, tp_now = False, true_positions(llm)
            union = UnionScores(*resident(llm, g, tp_now, aside), aside, scores.queries, scores.pos_last,
                                scores.draft_queries if cfg.lookahead else None, cfg.lookahead_share, n)
            present = union.present().reshape(L, G, n)
            layer_scores = union.layer
        else:
            fresh = g.n_compacted == 0 and g.n_used == n and scores.pos_last == g.pos_max
            tp_now = None if fresh else true_positions(llm)
            if fresh:   # cells are positions: no mapping needed
                layer_scores = lambda l: scores.scores[l, :, :n]        # noqa: E731
            else:
                present = self._by_position(tp_now, n, tp_now >= 0).reshape(L, G, n)
                layer_scores = lambda l: self._layer_scores_by_position(scores, present, l, n, H, r)    # noqa: E731
        available = None if fresh else page_scores(present.astype(np.float32), cfg.page_size, "max") > 0
        values = self._values_by_position(llm, tp_now, n, L, G) if cfg.value_power > 0 else None
        sel = self.policy.select_layers(layer_scores, L, r, n, available=available, n_keep=n_keep, values=values)
        positions = pages_to_positions(sel.pages, cfg.page_size, n)
        brought = swa_dropped = 0
        if union is not None:
            brought = swap_in(llm, g, tp_now, positions.reshape(L * G, -1), aside, self.swap_rows)
            tp_now = true_positions(llm) if brought else tp_now
        t1 = time.perf_counter()
        if cfg.policy != "full":
            if fresh:
                cells = positions.reshape(L * G, -1)
            else:
                cells = self._cells_of(tp_now, positions.reshape(L * G, -1), n)
            if before_compact is not None:
                before_compact(tp_now, cells)
            compact(llm, cells)
            if g.is_iswa:       # the sliding-window layers' cache: only what their window still sees
                swa_dropped = swa_trim(llm)
        t2 = time.perf_counter()
        result = EvictionResult(sel, positions)
        result.metrics = self._metrics(llm, L, H, r, sel, positions, n, needles)
        result.metrics.update(reselected=union is not None, reselected_tokens=brought, swa_dropped=swa_dropped)
        # where the time went: selection (scores to kept positions), compaction, the metrics (UOR replay etc.)
        result.metrics["timing"] = {"select_s": t1 - t0, "compact_s": t2 - t1,
                                    "metrics_s": time.perf_counter() - t2}
        return result

    @staticmethod
    def _layer_scores_by_position(scores: WindowScores, present: np.ndarray, l: int, n: int, H: int,
                                  r: int) -> np.ndarray:
        """Layer l's scores [H, n] indexed by true position; ``present`` [L, G, n]: the positions each
        group buffer holds. Held but never observed (decoded after the window): the mean of the
        head's observed held keys; not held: 0."""
        G = H // r
        slot_of = head_slots(present.shape[0], H, G)                              # [L, H]
        group_of = np.arange(H) // r
        tp_obs = scores.true_pos[slot_of[l]]                                      # [H, n_kv]
        hi, ci = np.nonzero((tp_obs >= 0) & (tp_obs < n))
        at = tp_obs[hi, ci]
        sl = np.zeros((H, n), dtype=np.float64)
        sl[hi, at] = scores.scores[l, hi, ci]
        scored = np.zeros((H, n), dtype=bool)
        scored[hi, at] = True
        held = present[l, group_of]                                               # [H, n]
        unscored = held & ~scored
        if unscored.any():
            known = held & scored
            mean = np.where(known, sl, 0.0).sum(-1) / np.maximum(known.sum(-1), 1)
            sl[unscored] = np.broadcast_to(mean[:, None], sl.shape)[unscored]
        sl[~held] = 0.0
        return sl

    @staticmethod
    def _values_by_position(llm, tp_now: np.ndarray | None, n: int, L: int, G: int) -> np.ndarray:
        """float32 [L, G, n]: the norm of the value vector each group buffer holds for each
        position (0 where it holds none). tp_now None: cells are positions."""
        vn = value_norms(llm)                                                     # [L * G, kv_size]
        if tp_now is None:
            return vn[:, :n].reshape(L, G, n)
        return EvictionController._by_position(tp_now, n, vn).reshape(L, G, n)

    @staticmethod
    def _by_position(tp_now: np.ndarray, n: int, per_cell: np.ndarray) -> np.ndarray:
        """[n_slots, n]: per_cell [n_slots, kv_size] moved from each slot's cells to the true
        positions they hold (zero / False at the positions a slot does not hold)."""
        out = np.zeros((tp_now.shape[0], n), dtype=per_cell.dtype)
        si, ci = np.nonzero((tp_now >= 0) & (tp_now < n))
        out[si, tp_now[si, ci]] = per_cell[si, ci]
        return out

    @staticmethod
    def _cells_of(tp_now: np.ndarray, keep_pos: np.ndarray, n: int) -> np.ndarray:
        """int32 [n_slots, K]: per slot, the (ascending) cells holding the kept positions."""
        n_slots = tp_now.shape[0]
        want = np.zeros((n_slots, n), dtype=bool)
        want[np.arange(n_slots)[:, None], keep_pos] = True
        tp = np.where(tp_now >= 0, tp_now, 0)
        hit = (tp_now >= 0) & want[np.arange(n_slots)[:, None], tp]
        counts = hit.sum(axis=1)
        if (counts != keep_pos.shape[1]).any():
            raise ValueError("a selected position is not in its group buffer any more")
        return np.nonzero(hit)[1].reshape(n_slots, -1).astype(np.int32)

    def _metrics(self, llm, L, H, r, sel, positions, n, needles) -> dict:
        cfg = self.config
        g = geometry(llm)
        G = H // r
        n_pages = cfg.n_pages(n)
        u = M.uor(sel.head_pages, r, n_pages)
        d = M.disagreement(sel.head_pages, r, n_pages)
        st = sel.stats
        K = positions.shape[-1]
        per_layer = []
        for layer in g.layers:
            hk = layer.k_bytes_per_cell // layer.n_head_kv
            hv = layer.v_bytes_per_cell // layer.n_head_kv
            per_layer.append({"il": layer.il, "pages_per_group": int(sel.pages.shape[-1]), "tokens_per_group": K,
                              "k_bytes": K * hk * layer.n_head_kv, "v_bytes": K * hv * layer.n_head_kv})
        total = sum(x["k_bytes"] + x["v_bytes"] for x in per_layer)
        # the entropy weights the policy used (entrokv-edge: over its entropy region), else the method's
        w_iso = sel.weights if cfg.policy == "entrokv-edge" and cfg.head_pool == "entropy" else \
            head_weights(st.c_iso, r, cfg.tau)
        out = {
            "policy": cfg.policy, "logical_tokens": n, "page_size": cfg.page_size, "window": cfg.window,
            "budget_pages": sel.n_budget, "kept_pages": int(sel.pages.shape[-1]), "kept_tokens": K,
            "policy_uor": sel.pages.shape[-1] / sel.n_budget,
            "uor_mean": float(u.mean()), "uor_max": float(u.max()), "uor_count": int(u.size),
            "disagreement_mean": float(d.mean()),
            "kv_bytes_full": n * g.bytes_per_cell if cfg.policy != "full" else total,
            "kv_bytes_kept": total, "kv_bytes_engine": g.n_used * g.bytes_per_cell,
            "layers": per_layer,
            "heads": {
                "collision_entropy": (-np.log(np.maximum(st.c_iso, 1e-300))).tolist(),
                "weights": w_iso.tolist(),
                "sink_mass": np.where(st.mass_all > 0, 1.0 - st.mass_iso / np.where(st.mass_all > 0, st.mass_all, 1.0),
                                      0.0).tolist(),
                "masquerade_ratio": (head_weights(st.c_all, r, cfg.tau) /
                                     np.maximum(head_weights(st.c_iso, r, cfg.tau), 1e-300)).tolist(),
                "all_on_sinks": st.flagged.tolist(),
            },
        }
        if needles is not None:
            need = np.asarray(list(needles), dtype=np.int64)
            kept = np.zeros((L, G, n), dtype=bool)
            li, gi, _ = np.indices(positions.shape)
            kept[li, gi, positions] = True
            out["needle_kept"] = kept[:, :, need].all(axis=-1).tolist()
        return out


# the name the README first documented for this class: kept as an alias of it
PageEntroKV = EvictionController


# --- the runtime's step ------------------------------------------------------------------------

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


def capacity_pages(rt) -> int:
    """Pages an eviction of runtime ``rt`` (an EntroKVLlama) may keep so that new tokens still find room."""
    return (rt.kv_cells - rt.reserve) // rt.config.page_size


def budget_pages(rt, n: int) -> int:
    """The pages every group buffer of ``rt`` keeps after n tokens: the budget's, within the capacity."""
    capacity = capacity_pages(rt)
    try:    # no budget given: what the cache can keep with room for new tokens
        N = rt.config.budget_pages(n, capacity * rt.config.page_size)
    except ValueError:
        N = len(rt.config.protected(n))
    return min(N, capacity)


def recency_scores(rt) -> WindowScores:
    """Scores that favour recent tokens, for an eviction before any observation."""
    g = geometry(rt)
    tp = true_positions(rt)
    H = llama_cpp.llama_model_n_head(rt.model)
    L, G = g.n_layers, g.layers[0].n_head_kv
    slot_of = head_slots(L, H, G)
    s = np.where(tp[slot_of] >= 0, tp[slot_of] + 1.0, 0.0).astype(np.float32)
    s /= s.sum(-1, keepdims=True)
    return WindowScores(s, tp, np.array([l.il for l in g.layers], np.int32), 0, 0, g.pos_max)


def full_refusal(rt, n: int) -> str:
    """Why the full policy (which keeps every token) cannot hold ``n`` tokens in ``rt``'s cache."""
    return (f"the full policy keeps every token: {n} tokens need a cache of at least {n} cells, this one has "
            f"{rt.kv_cells} (give a larger n_ctx / --kv-cells, or an evicting policy)")


def evict(rt, n_keep: int | None = None, controller: EvictionController | None = None,
          reselect: bool = False, scores: WindowScores | None = None) -> EvictionResult:
    """Evict runtime ``rt`` (an EntroKVLlama) now, with its freshest window scores, down to ``n_keep`` pages
    (default: the budget for the logical length, within the cache's capacity). ``controller``: one with other
    settings for this eviction only (a guided eviction's consensus); ``reselect``: the eviction after a prompt
    read in pieces, which may choose what earlier ones set aside. ``scores``: instead of the freshest window
    scores, the queries of a turn taken out of the cache to be read again (the eviction chooses among the
    cache and the recall's store by them: ``EvictionController.evict``'s ``ahead``). The tokens that leave go
    to the recall's store, or to the read's own while a prompt is read in pieces."""
    n = rt.n_tokens
    if n == 0:
        raise ValueError("nothing to evict: the context is empty")
    ahead = scores is not None
    scores = scores or rt._window_scores or recency_scores(rt)
    N = budget_pages(rt, n) if n_keep is None else n_keep
    if rt.config.policy == "full":
        raise ValueError(full_refusal(rt, n + 1))
    t0 = time.perf_counter()
    aside = (rt.recall.store if rt.recall else rt._aside) if reselect or ahead else None  # recall's, or the read's
    if rt.recall:
        hand_over = lambda tp, cells: rt.recall.on_evict(rt, tp, cells)      # noqa: E731
    elif rt._aside is not None and not reselect:      # (the read's own is dropped after its last eviction)
        hand_over = lambda tp, cells: set_aside(rt, rt._aside, tp, cells)    # noqa: E731
    else:
        hand_over = None
    hook = hand_over
    if rt.events.wants("compacting"):
        def hook(tp, cells):
            rt.events.emit("compacting", rt=rt, true_pos=tp, cells=cells)
            if hand_over is not None:
                hand_over(tp, cells)
    controller = controller or rt.controller
    rt.events.emit("evicting", rt=rt, controller=controller, scores=scores, aside=aside)
    res = controller.evict(rt, scores, n_keep=N, before_compact=hook, aside=aside, ahead=ahead)
    rt.stats.reselected += res.metrics.get("reselected_tokens", 0)
    if rt.recall:
        rt.recall.n_keep = geometry(rt).n_compacted
    release_freed_memory()
    rt.stats.eviction_s += time.perf_counter() - t0
    rt.stats.evictions += 1
    if res.metrics["kept_tokens"] > rt.kv_cells - rt.config.window:
        raise EntroKVError(-5, f"policy {rt.config.policy} kept {res.metrics['kept_tokens']} tokens, "
                               f"more than the cache ({rt.kv_cells} cells) can hold with room to go on")
    rt.last_eviction = res
    rt.events.emit("evicted", rt=rt, controller=controller, result=res)
    return res
