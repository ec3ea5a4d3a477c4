"""The settings a user gives the controller, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass

# the method doc's policy and the baselines it must be compared with
METHOD_POLICIES = ("page-entrokv", "mean-pool", "max-pool", "head-independent", "no-isolation", "streaming", "full")
# every policy name accepted: the method's, and our own variant (docs/method.md, "entrokv-edge")
POLICIES = METHOD_POLICIES + ("entrokv-edge",)
# entrokv-edge's settings where the user leaves them unset (None); page-entrokv = all off.
# Chosen by benchmarks/research/variants.py's rounds (round 4: page_size 4, pool 7, spread 24, decay 0.85, rank; round 6
# added lookahead 24; round 7: page_size 2, pool 3, decay 0.7, lookahead_share 0.85; round 1's: page_size 16,
# pool 7, rank)
EDGE_DEFAULTS = {"page_size": 2, "pool": 3, "spread": 24, "decay": 0.7, "consensus": 0.0, "entropy_region": "sinks",
                 "head_pool": "rank", "value_power": 0.0, "lookahead": 24, "lookahead_share": 0.85,
                 "guide_consensus": 0.25,     # benchmarks/long_prompt.py, round 5
                 "reselect": True}            # benchmarks/long_prompt.py, round 6
OFF = {"page_size": 16, "pool": 0, "spread": 0, "decay": 1.0, "consensus": 0.0, "entropy_region": "sinks",
       "head_pool": "entropy", "value_power": 0.0, "lookahead": 0, "lookahead_share": 0.0, "guide_consensus": 0.0,
       "reselect": False}
EDGE_OPTIONS = ("pool", "spread", "decay", "consensus", "entropy_region", "head_pool", "value_power", "lookahead",
                "lookahead_share", "guide_consensus", "reselect")
MAX_LOOKAHEAD = 64
# the budget when none is given: a fraction of the prompt for the controller alone (EvictionController); EntroKVLlama,
# which knows its cache, keeps what the cache can hold with room for new tokens instead (runtime/eviction.py)
DEFAULT_BUDGET = 0.2
ENTROPY_REGIONS = ("sinks", "evictable")
HEAD_POOLS = ("entropy", "max", "rank")


@dataclass(frozen=True)
class EvictionConfig:
    """Page-EntroKV settings (definitions: docs/method.md; every setting: docs/options.md).

    budget     : tokens per group buffer (int >= 1) or a fraction of the prompt (0 < float <= 1);
                 rounded down to whole pages. None: EntroKVLlama keeps what its cache can hold with room
                 for new tokens; the controller alone keeps DEFAULT_BUDGET of the prompt
    page_size  : P, tokens per page
    window     : w, observation window (last w prompt tokens)
    sinks      : s, leading positions isolated as attention sinks and always kept
    recent     : rho, trailing tokens always kept (None: = window); must be >= window
    tau        : temperature of the entropy weights
    policy     : one of POLICIES
    page_score : "sum" (attention mass of the page) or "max"

    Options of the entrokv-edge policy only (None: its defaults, EDGE_DEFAULTS; the other
    policies keep them off and refuse other values):
    pool           : k, width of a 1-D max pooling over key positions of each head's scores
                     before they are projected onto pages (SnapKV's smoothing; 0 or 1: none)
    spread         : s, the pooling window of each key reaches s keys further back: a key's
                     score also covers the s keys after it (a fact follows the words that
                     point at it); with pool k the window of key i is [i - k//2 - s, i + k//2]
    decay          : g in (0, 1], the spread's discount: in key i's window, a key j before
                     i - k//2 counts at g ** (i - k//2 - j) of its score (1: no discount)
    consensus      : share of each buffer's free pages (budget minus protected) kept by every
                     (layer, group) alike: the pages with the highest mean page score over all
                     buffers (each buffer's scores normalized to one vote)
    entropy_region : keys the collision entropy of the head weights is taken over: "sinks"
                     (all but the sinks, the method) or "evictable" (outside the protected pages)
    head_pool      : how a group's heads are pooled: "entropy" (the method's weights), "max"
                     (the largest share any head gives a page) or "rank" (the best rank any
                     head gives a page: the head-independent union cut to the budget)
    value_power    : a in [0, 4] (0: off): each head's score of key t is multiplied by ||v_t||^a, the
                     norm of the value vector its group buffer holds for t (read from the cache):
                     what a head's output loses with a key is its attention times that value, so
                     keys with small values matter less (VATP's value-aware score, generalized)
    lookahead      : k in [0, MAX_LOOKAHEAD] (0: off): before the eviction after a prompt, up to k
                     tokens are drafted greedily with the whole cache and their attention joins
                     the window's (mixed by lookahead_share); the drafted tokens are then removed,
                     so they only decide what is kept (runtime/drafts.py). The window
                     sees the question; the draft sees where the answer looks
    lookahead_share: x in [0, 1]: the draft's share of the mixed scores, (1 - x) x the window's
                     mean + x x the drafted tokens' mean; 0: each query one vote (w window
                     queries and d drafted ones: the draft's share is d / (w + d))
    page_size None: 16 (or entrokv-edge's default).

    Every policy but streaming and full, on prompts longer than EntroKVLlama's cache (read in pieces,
    with an eviction between pieces):
    guide          : g >= 0 (0: off): before each eviction between pieces, the prompt's last g tokens (the
                     question and the assistant header that end it; or a guide given to eval) are
                     evaluated after the piece with their attention observed, then removed again, and
                     their attention (normalized over the cached keys) joins the piece's window scores,
                     so that what the end of the prompt asks for survives the evictions before it is read
                     (FINCH's prompt-guided compression, per (layer, KV group) at the exact budget)
    guide_share    : x in [0, 1]: the guide's share of the mixed scores, (1 - x) x the piece's window + x x
                     the guide's
    guide_draft    : k in [0, MAX_LOOKAHEAD]: tokens drafted greedily after the guide, whose attention
                     joins the guide's as lookahead's joins the window after a prompt (weighed by
                     lookahead_share); 0: none
    guide_consensus: the consensus share (as ``consensus``) of each guided eviction between pieces, an
                     entrokv-edge option: a fact the guide finds in some buffers is kept in all of
                     them before the question itself is read (the final eviction keeps ``consensus``)
    reselect       : True / False, an entrokv-edge option: what the evictions between pieces drop is set
                     aside (K/V rows outside the cache) until the prompt is read; the eviction after it then
                     scores the cached and the set-aside tokens alike (the exact attention of its window and
                     lookahead draft) and selects from all of them, the chosen set-aside tokens written back
                     (runtime/reselect.py). Not with value_power > 0 (set-aside values are not read)
    """

    budget: float | int | None = None
    page_size: int | None = None
    window: int = 32
    sinks: int = 4
    recent: int | None = None
    tau: float = 1.0
    policy: str = "entrokv-edge"        # won the held-out split (benchmarks/research/variants.py); the method: "page-entrokv"
    page_score: str = "sum"
    pool: int | None = None
    spread: int | None = None
    decay: float | None = None
    consensus: float | None = None
    entropy_region: str | None = None
    head_pool: str | None = None
    value_power: float | None = None
    lookahead: int | None = None
    lookahead_share: float | None = None
    guide: int = 32
    guide_share: float = 1.0
    guide_draft: int = 8                # chosen on the tune prompts (benchmarks/long_prompt.py, tune round 2)
    guide_consensus: float | None = None
    reselect: bool | None = None

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"EvictionConfig: {msg}")

        if self.policy not in POLICIES:
            bad(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        defaults = EDGE_DEFAULTS if self.policy == "entrokv-edge" else OFF
        for name, v in defaults.items():      # resolve unset options (the dataclass is frozen)
            if getattr(self, name) is None:
                object.__setattr__(self, name, v)
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 0:
            bad(f"pool must be an integer >= 0, got {self.pool!r}")
        if self.pool > 1 and self.pool % 2 == 0:
            bad(f"pool must be odd (a window centred on each key), got {self.pool}")
        if isinstance(self.spread, bool) or not isinstance(self.spread, int) or self.spread < 0:
            bad(f"spread must be an integer >= 0, got {self.spread!r}")
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or \
                not (0.0 < self.decay <= 1.0):
            bad(f"decay must be a number in (0, 1], got {self.decay!r}")
        for name in ("consensus", "guide_consensus"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= v < 1.0):
                bad(f"{name} must be a share in [0, 1), got {v!r}")
        if not isinstance(self.reselect, bool):
            bad(f"reselect must be True or False, got {self.reselect!r}")
        if isinstance(self.value_power, bool) or not isinstance(self.value_power, (int, float)) or \
                not (0.0 <= self.value_power <= 4.0):
            bad(f"value_power must be a number in [0, 4], got {self.value_power!r}")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or \
                not (0 <= self.lookahead <= MAX_LOOKAHEAD):
            bad(f"lookahead must be an integer in [0, {MAX_LOOKAHEAD}], got {self.lookahead!r}")
        if isinstance(self.lookahead_share, bool) or not isinstance(self.lookahead_share, (int, float)) or \
                not (0.0 <= self.lookahead_share <= 1.0):
            bad(f"lookahead_share must be a number in [0, 1], got {self.lookahead_share!r}")
        if self.head_pool not in HEAD_POOLS:
            bad(f"head_pool must be one of {', '.join(HEAD_POOLS)}, got {self.head_pool!r}")
        if self.entropy_region not in ENTROPY_REGIONS:
            bad(f"entropy_region must be one of {', '.join(ENTROPY_REGIONS)}, got {self.entropy_region!r}")
        if self.policy != "entrokv-edge":
            on = [f"{k}={getattr(self, k)!r}" for k in EDGE_OPTIONS
                  if getattr(self, k) != OFF[k] and not (k == "pool" and getattr(self, k) == 1)]
            if on:
                bad(f"{', '.join(on)}: these options belong to the entrokv-edge policy, not {self.policy!r}")

        if isinstance(self.guide, bool) or not isinstance(self.guide, int) or self.guide < 0:
            bad(f"guide must be an integer >= 0 (tokens), got {self.guide!r}")
        if isinstance(self.guide_share, bool) or not isinstance(self.guide_share, (int, float)) or \
                not (0.0 <= self.guide_share <= 1.0):
            bad(f"guide_share must be a number in [0, 1], got {self.guide_share!r}")
        if isinstance(self.guide_draft, bool) or not isinstance(self.guide_draft, int) or \
                not (0 <= self.guide_draft <= MAX_LOOKAHEAD):
            bad(f"guide_draft must be an integer in [0, {MAX_LOOKAHEAD}], got {self.guide_draft!r}")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, (int, float))):
            bad(f"budget must be a token count or a fraction, got {self.budget!r}")
        if isinstance(self.budget, float) and not (0.0 < self.budget <= 1.0):
            bad(f"a fractional budget must be in (0, 1], got {self.budget}")
        if isinstance(self.budget, int) and self.budget < 1:
            bad(f"a token budget must be >= 1, got {self.budget}")
        for name in ("page_size", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.sinks, int) or isinstance(self.sinks, bool) or self.sinks < 0:
            bad(f"sinks must be an integer >= 0, got {self.sinks!r}")
        if self.recent is not None and (not isinstance(self.recent, int) or isinstance(self.recent, bool)
                                        or self.recent < self.window):
            bad(f"recent must be an integer >= window ({self.window}), got {self.recent!r}")
        if not (isinstance(self.tau, (int, float)) and self.tau > 0 and math.isfinite(self.tau)):
            bad(f"tau must be a positive number, got {self.tau!r}")
        if self.page_score not in ("sum", "max"):
            bad(f"page_score must be 'sum' or 'max', got {self.page_score!r}")
        if isinstance(self.budget, int) and self.policy != "full":
            need = -(-self.sinks // self.page_size) + -(-self.rho // self.page_size)
            if self.budget // self.page_size < need:
                bad(f"budget of {self.budget} tokens = {self.budget // self.page_size} pages of {self.page_size} is "
                    f"smaller than the {need} protected pages (sinks {self.sinks}, recent {self.rho})")

    @property
    def rho(self) -> int:
        return self.window if self.recent is None else self.recent

    def n_pages(self, n: int) -> int:
        """Pages of a prompt of n tokens (the last may be partial)."""
        return -(-n // self.page_size)

    def protected(self, n: int) -> "list[int]":
        """Page indices every group keeps: pages holding a sink, and the last ceil(rho / P) pages."""
        n_pages = self.n_pages(n)
        sink_pages = set(range(-(-min(self.sinks, n) // self.page_size)))
        recent_pages = set(range(max(0, n_pages - -(-self.rho // self.page_size)), n_pages))
        return sorted(sink_pages | recent_pages)

    def budget_tokens(self, n: int, capacity: int | None = None) -> int:
        """Token slots per group buffer for a prompt of n tokens: the budget's, or (budget None)
        ``capacity`` when a cache bounds it, else DEFAULT_BUDGET of the prompt."""
        budget = self.budget
        if budget is None:
            if capacity is not None:
                return int(capacity)
            budget = DEFAULT_BUDGET
        return int(budget * n) if isinstance(budget, float) else int(budget)

    def budget_pages(self, n: int, capacity: int | None = None) -> int:
        """N: pages every (layer, group) keeps for a prompt of n tokens (checked); ``capacity``:
        the tokens a cache can keep, which a budget of None means."""
        if self.window > n:
            raise ValueError(f"window w={self.window} is longer than the prompt ({n} tokens)")
        tokens = self.budget_tokens(n, capacity)
        # a budget that covers the prompt keeps all of it, the partial last page included
        N = self.n_pages(n) if tokens >= n else min(tokens // self.page_size, self.n_pages(n))
        need = len(self.protected(n))
        if self.policy != "full" and N < need:
            raise ValueError(
                f"budget of {tokens} tokens = {N} pages of {self.page_size} is smaller than the "
                f"{need} protected pages (sinks {self.sinks}, recent {self.rho}); raise the budget")
        return self.n_pages(n) if self.policy == "full" else N
