"""The recall tier: evicted tokens kept outside the attention cache, and brought back when the
queries being answered want them.

At every eviction, the tokens that leave a group buffer (a (layer, KV head) slot) go to the
store: their K and V rows in the cache's own types, their true positions, and per page of
``page_size`` true positions the mean of its keys (the digest, a float vector per page). Then,
per slot:

- while the runtime generates, each decoded token's queries and its attention over the cache are
  observed (the attention as the decode computed it: a copy, not a second pass over the cache); every
  ``every`` tokens that attention (where the decode made none, the queries against every held key; a held
  draft's queries, not decoded, the same way) scores the cache exactly, the digests rank the stored pages
  by the attention mass their mean key would get (relative to the cache's log-sum-exp; in C), and the top
  ``pages`` pages are read and scored exactly;
- at a new turn, the same with the turn's observed queries and ``turn_pages`` pages; those queries were
  computed on the cache before the recall, so the turn's window is then evaluated again on the recalled
  cache and its new queries recall once more (``turn_requery``); then the answer's first tokens are
  drafted and drive a last recall (``turn_draft``);
- a page comes back when its mass beats the mass of the resident tokens it displaces (the least
  attended whole eviction pages, never a protected sink or recent page), which go to the store in
  its place.

Every group buffer keeps exactly its budget (UOR = 1); positions stay correct, since keys keep
their RoPE and the true-position table follows every swap. The design and its figures (mean
key digest, pages of 16, every = 4, pages = 8, turn_pages = 128, the draft, the requery): docs/research.md,
"The recall tier".
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ...bindings import geometry, read_cells, true_positions
from ...bindings.observe import WindowScores
from ...controller.policies import Policy
from ..events import Events
from ..stats import RuntimeStats
from ..store import Store, new_store, set_aside
from .config import RecallConfig
from .swap import ComputedAttention, DecodedAttention, swap

ROWS_BYTES = 64 << 20       # the decoded steps' attention kept between two recalls (about 9 MiB on Qwen2.5 at 8k)


class Recall:
    """Observes decoded tokens (``observe``, an Observation handler with window 1), swaps stored
    pages into the cache (``step`` every ``every`` tokens, ``turn`` at a new turn)."""

    def __init__(self, config: RecallConfig, policy: Callable[[], Policy], stats: RuntimeStats,
                 events: Events | None = None):
        """``policy``: a callable giving the eviction policy in force (its page size, and its protected
        pages - sinks, recent, what a wrapper adds - that are never displaced); ``stats``: the runtime's
        counters, which the recalls add to; ``events``: the runtime's (a recall emits "recall_inputs")."""
        self.config, self._policy, self.stats, self.events = config, policy, stats, events or Events()
        self.rows_bytes = ROWS_BYTES          # the most the decoded steps' attention may take between two recalls
        self.page = config.page_size
        self.store: Store | None = None
        self.steps: list[tuple] = []          # per observed token: (queries [L, H, d], its true position, its
                                              # attention over the compacted cells [S, r, n_keep] or None: a view
                                              # of _att, whose column i is step i's)
        self._att = None                      # float32 [S, capacity, r, n_keep]: the steps' attention, already in
                                              # the layout the recall reads (no stacking at a recall)
        self.n_keep = 0                       # compacted cells after the last eviction (set by the runtime)
        self.n_at_eviction = 0                # logical length at the last eviction
        self.held: tuple | None = None        # hold_draft: the last turn's draft queries [L, k, H, d], positions [k]
        self.keys = ResidentKeys()            # the compacted cells' keys, kept between recalls
        self.dropped = 0                      # evicted tokens per slot not stored (the store at store_mib)

    @property
    def policy(self) -> Policy:
        return self._policy()

    # --- eviction -----------------------------------------------------------------

    def _new_store(self, g) -> Store:
        # a store page is whole eviction pages: what leaves and comes back keeps every buffer made of whole
        # pages, which the next eviction selects from
        P = self.policy.config.page_size
        self.page = -(-self.config.page_size // P) * P
        return new_store(g, self.page, self.config.directory)

    def on_evict(self, llm, tp_now: np.ndarray | None, cells: np.ndarray) -> None:
        """Before a compaction that keeps ``cells`` [n_slots, K] (tp_now: the slots' true positions,
        None when cells are positions): the slots' other tokens go to the store."""
        g = geometry(llm)
        self.n_at_eviction = g.pos_max + 1
        if self.store is None:
            self.store = self._new_store(g)
        self.steps.clear()
        self.held = None
        self.keys.clear()                     # compaction moves the cells
        self._att = None                      # and changes n_keep
        cap = None if self.config.store_mib is None else int(self.config.store_mib * (1 << 20))
        self.dropped += set_aside(llm, self.store, tp_now, cells, g, cap)

    def reset(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store, self.steps, self.n_keep, self.n_at_eviction, self.dropped = None, [], 0, 0, 0
        self.held = None
        self.keys.clear()
        self._att = None

    # --- sessions -------------------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """The store as arrays (what a saved session keeps); the digests are recomputed on load."""
        st = self.store
        if st is None or not st.n_tokens:
            return {}
        e = np.broadcast_to(np.arange(st.n_tokens), st.pos.shape)
        si = np.broadcast_to(np.arange(st.pos.shape[0])[:, None], st.pos.shape)
        # the tokens observed since the last recall: a restored session recalls when this one would
        q = np.stack([x[0] for x in self.steps]) if self.steps else np.zeros(0, np.float32)
        out = {"recall_pos": st.pos.copy(), "recall_k": st.k.gather(si, e), "recall_v": st.v.gather(si, e),
               "recall_info": np.array([self.n_keep, self.n_at_eviction], np.int64),
               "recall_q": q, "recall_qpos": np.array([x[1] for x in self.steps], np.int64)}
        if self.steps and all(x[2] is not None for x in self.steps):      # their attention as the decode computed it
            L, H = q.shape[1], q.shape[2]
            out["recall_rows"] = np.stack([x[2].reshape(L, H, -1) for x in self.steps])     # [steps, L, H, n_keep]
        if self.held is not None:
            out["recall_hq"], out["recall_hpos"] = self.held[0].copy(), self.held[1].astype(np.int64)
        return out

    def load(self, llm, a: dict) -> None:
        """Restore a store saved by ``arrays`` into this (emptied) recall, for ``llm``'s cache;
        ValueError if the arrays do not fit it."""
        self.reset()
        if not a:
            return
        g = geometry(llm)
        pos, k, v, info = (np.asarray(a[x]) for x in ("recall_pos", "recall_k", "recall_v", "recall_info"))
        q = np.asarray(a["recall_q"])
        qpos = np.asarray(a["recall_qpos"]) if "recall_qpos" in a else None     # None: saved by an older version
        n_steps = q.shape[0] if q.ndim == 4 and qpos is not None else 0
        if n_steps and (qpos.shape != (n_steps,) or q.shape[1] != g.n_layers or qpos.min() < 0
                        or qpos.max() > g.pos_max):
            raise ValueError("its recall store's observed steps do not fit this cache")
        rows = np.asarray(a["recall_rows"], np.float32) if "recall_rows" in a else None
        if rows is not None and (rows.ndim != 4 or rows.shape[:3] != q.shape[:3] or info.shape != (2,)
                                 or rows.shape[3] != int(info[0])):
            raise ValueError("its recall store's observed attention does not fit this cache")
        held = None
        if "recall_hq" in a:
            held = (np.asarray(a["recall_hq"], np.float32), np.asarray(a["recall_hpos"], np.int64))
            if held[0].ndim != 4 or held[0].shape[0] != g.n_layers or held[1].shape != (held[0].shape[1],):
                raise ValueError("its recall store's held draft does not fit this cache")
        store = self._new_store(g)
        M = pos.shape[-1] if pos.ndim == 2 else -1
        if (pos.ndim != 2 or pos.shape[0] != g.n_slots or k.shape != (g.n_slots, M, store.k.width)
                or v.shape != (g.n_slots, M, store.v.width) or info.shape != (2,) or int(info[0]) != g.n_compacted
                or (M and (pos.min() < 0 or pos.max() > g.pos_max))):
            store.close()
            raise ValueError("its recall store does not fit this cache")
        store.add(pos.astype(np.int32), np.ascontiguousarray(k, np.uint8), np.ascontiguousarray(v, np.uint8))
        self.store = store
        self.n_keep, self.n_at_eviction = int(info[0]), int(info[1])
        self.steps = [(q[i], int(qpos[i]), None) for i in range(n_steps)]
        if rows is not None and n_steps:
            self._keep_rows(n_steps, rows.transpose(1, 2, 0, 3), g.n_slots)     # [L, H, steps, n_keep]
        if held is not None and self.config.hold_draft:
            self.held = held

    # --- generation -----------------------------------------------------------------

    def observe(self, view: WindowScores) -> None:
        """Inside llama_decode, for a decoded token (the decode observer): keep its queries, its position
        and, where the decode handed them over, its attention over the compacted cells (``view.rows``). The
        attention is kept while every step since the last recall has it, on a cache of floats (a quantized
        K rounds the decode's queries too coarsely for the log-sum-exp taken from it), and within
        ``rows_bytes``; otherwise the recall computes it."""
        if view.queries is None or self.n_keep == 0:
            return
        rows, n = view.rows, self.n_keep
        had = bool(self.steps) and self.steps[-1][2] is not None        # the steps have it all, or none of them
        keep = (rows is not None and rows.shape[2] >= n and self.store is not None
                and self.store.type_k in ("f32", "f16", "bf16") and (had or not self.steps)
                and (len(self.steps) + 1) * rows.shape[0] * rows.shape[1] * n * 4 <= self.rows_bytes)
        if had and not keep:
            self.steps = [(q, p, None) for q, p, _ in self.steps]        # no longer of use
            self._att = None
        self.steps.append((view.queries[:, -1].copy(), int(view.pos_last), None))
        if keep:
            self._keep_rows(1, rows[:, :, None, :n], self.store.pos.shape[0])

    def _keep_rows(self, m: int, rows: np.ndarray, S: int) -> None:
        """The attention rows [L, H, m, n_keep] of the last m steps, written into _att (grown as needed) and
        given to those steps as views."""
        L, H, _, n = rows.shape
        r = H // (S // L)
        i = len(self.steps) - m
        att = self._att
        if i and (att is None or att.shape[0] != S or att.shape[2:] != (r, n)):   # (the earlier steps' are not of
            self.steps = [(q, p, None) for q, p, _ in self.steps]                 # this layout: none is kept)
            self._att = None
            return
        if att is None or att.shape[1] < i + m:
            fit = max(1, self.rows_bytes // (S * r * n * 4))          # steps whose attention is kept at most
            cap = max(i + m, min(max(self.config.every, 2 * (0 if att is None else att.shape[1])), fit))
            new = np.empty((S, cap, r, n), np.float32)
            if i:                   # the earlier steps' rows (each of them has its attention) move over
                new[:, :i] = att[:, :i]
            att = self._att = new
        att[:, i: i + m] = rows.reshape(S, r, m, n).transpose(0, 2, 1, 3)
        self.steps[:] = [(q, p, att[:, j]) for j, (q, p, _) in enumerate(self.steps)]   # all: the buffer may be new

    def due(self) -> bool:
        return self.store is not None and self.store.n_tokens > 0 and len(self.steps) >= self.config.every

    def step(self, llm) -> int:
        """One recall from the decoded tokens observed since the last; returns the tokens brought
        back (all slots together)."""
        steps, self.steps = self.steps, []
        if not steps:
            return 0
        q, qpos = np.stack([x[0] for x in steps], 1), np.array([x[1] for x in steps])
        # the decode's own attention of every step, where each has it (else it is computed below, exactly)
        att = None
        if self._att is not None and all(x[2] is not None and x[2].base is self._att for x in steps):
            att = self._att[:, : len(steps)]
        if self.held is not None:          # hold_draft: the draft's queries for the answer tokens not decoded yet
            hq, hpos = self.held
            ahead = hpos > qpos.max()
            if ahead.any():                # their attention is computed; the decoded steps keep theirs
                q, qpos = np.concatenate([q, hq[:, ahead]], 1), np.concatenate([qpos, hpos[ahead]])
            else:
                self.held = None
        return self._recall(llm, q, qpos, self.config.pages, att)

    def hold(self, queries: np.ndarray, pos_last: int) -> None:
        """hold_draft: keep a turn's draft queries (float32 [L, k, H, d], the last at ``pos_last``) for the
        decoding recalls of the answer's first k tokens."""
        if self.config.hold_draft:
            k = queries.shape[1]
            self.held = (queries, pos_last - k + 1 + np.arange(k))

    def turn(self, llm, queries: np.ndarray, pos_last: int) -> int:
        """A recall at a new turn, for its observed window's queries (float32 [L, w, H, d], the last
        at position ``pos_last``); ``turn_pages`` pages are offered per buffer. Returns the tokens
        brought back."""
        self.steps.clear()
        self.held = None
        if queries is None:
            return 0
        I = queries.shape[1]
        return self._recall(llm, queries, pos_last - I + 1 + np.arange(I), self.config.turn_pages)

    def _recall(self, llm, queries: np.ndarray, qpos: np.ndarray, n_pages: int, att_dec: np.ndarray | None = None) -> int:
        """A recall for queries float32 [L, I, H, d] at true positions qpos [I]: their attention over
        the cache, as the decode computed it for the first D queries (``att_dec`` float32 [S, D, r, n_keep],
        their attention over the compacted cells) and computed exactly from every held key for the
        others (causal by true position), then ``n_pages`` pages are offered per buffer."""
        self.events.emit("recalling", queries=queries, qpos=qpos, n_pages=n_pages, att=att_dec)
        g = self._ready(llm)
        if g is None:
            return 0
        L, I, H, d = queries.shape
        S, G = g.n_slots, g.n_slots // g.n_layers
        r = H // G
        # per slot [S, I, r, d]: a slot's query heads are consecutive (slot l * G + j reads heads j * r .. j * r + r - 1)
        qs = np.ascontiguousarray(np.asarray(queries, np.float32).reshape(L, I, G, r, d).transpose(0, 2, 1, 3, 4)
                                  ).reshape(S, I, r, d)
        n = self.n_keep
        tp = true_positions(llm)
        resident = self.keys.get(llm, g, tp, n, self.store)
        D, lse_dec = 0, None
        if att_dec is not None:
            q_dec = qs[:, : att_dec.shape[1]]                                 # [S, D, r, d]
            lse_dec = decoded_lse(q_dec, att_dec, resident)
            if lse_dec is not None:
                D = att_dec.shape[1]
                self.stats.recalls_on_decode += 1
        if D == I:
            attention, held = DecodedAttention(q_dec, att_dec, lse_dec), n
        else:
            cells, held_pos = held_cells(tp)
            later = None                    # the keys of the cells written since the eviction: read now
            if cells.shape[1] > n:
                k, _ = read_cells(llm, list(cells[:, n:]), g, buffers=True, keys_only=True)
                later = self.store.keys(k.reshape(S, cells.shape[1] - n, -1))
            attention = ComputedAttention(qs, qpos, resident, later, held_pos, n, D, att_dec, lse_dec)
            held = cells.shape[1]
        P = self.policy.config.page_size
        protect = np.zeros(max(int(tp[:, :n].max()) + 1, self.n_at_eviction) // P + 2, bool)
        protect[[p for p in self.policy.protected(self.n_at_eviction)]] = True     # sinks and recent pages
        moved = swap(llm, g, self.store, self.keys, tp[:, :n], attention, I * r, n_pages, held, protect, P,
                     self.events)
        self.stats.recalled += moved
        return moved

    def _ready(self, llm):
        """The geometry when a recall can run (a store, the compacted layout of the last eviction), else None."""
        st = self.store
        if st is None or not st.n_tokens or self.n_keep == 0:
            return None
        g = geometry(llm)
        return g if g.n_compacted == self.n_keep else None


class ResidentKeys:
    """The keys of the compacted cells, float32 [S, n_keep, d], read once after an eviction and kept up to
    date by the swaps (read again if their true positions are not the ones kept)."""

    def __init__(self):
        self.keys: np.ndarray | None = None
        self.pos: np.ndarray | None = None      # the true positions they were read for [S, n_keep]

    def clear(self) -> None:
        self.keys = self.pos = None

    def get(self, llm, g, tp: np.ndarray, n_keep: int, store: Store) -> np.ndarray:
        now = tp[:, :n_keep]
        if self.keys is None or not np.array_equal(self.pos, now):
            k, _ = read_cells(llm, [np.arange(n_keep, dtype=np.int32)] * g.n_slots, g, buffers=True, keys_only=True)
            self.keys = store.keys(k.reshape(g.n_slots, n_keep, -1))
            self.pos = now.copy()
        return self.keys

    def moved(self, cs: np.ndarray, cc: np.ndarray, kf: np.ndarray, pos: np.ndarray) -> None:
        """Cells cc of slots cs now hold keys kf [n, d] at true positions pos [n] (a swap)."""
        at = cs * self.keys.shape[1] + cc           # a flat row index
        self.keys.reshape(-1, self.keys.shape[-1])[at], self.pos.reshape(-1)[at] = kf, pos


def held_cells(tp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cells [S, held], their true positions [S, held]): the cells each slot holds, the compacted ones first
    (every slot holds as many: a token fills one cell in all)."""
    S = tp.shape[0]
    held = tp >= 0
    col = np.flatnonzero(held.any(0))
    if held[:, col].all():          # the usual case: every slot holds the same cells
        return np.broadcast_to(col.astype(np.int32), (S, col.size)), tp[:, col]
    cells = np.stack([np.flatnonzero(h) for h in held]).astype(np.int32)        # [S, held]: the same count
    return cells, np.take_along_axis(tp, cells, 1)


def decoded_lse(q: np.ndarray, att: np.ndarray, resident: np.ndarray) -> np.ndarray | None:
    """float32 [S, D, r]: the log-sum-exp over the cache of the queries q [S, D, r, d], from their attention
    as the decode computed it (att [S, D, r, n_keep], the softmax over the whole cache restricted to the
    compacted cells, whose keys are ``resident`` [S, n_keep, d]): a query's logit of the cell it attends
    most, minus the log of that attention. None where a query has no attention on the compacted cells."""
    S = q.shape[0]
    top = att.argmax(-1)                                                                  # [S, D, r]
    p_top = np.take_along_axis(att, top[..., None], -1)[..., 0]
    k_top = resident[np.arange(S)[:, None, None], top]                                       # [S, D, r, d]
    logit = np.einsum("sird,sird->sir", q, k_top)
    with np.errstate(divide="ignore"):
        lse = (logit - np.log(p_top)).astype(np.float32)
    return lse if np.isfinite(lse).all() else None
