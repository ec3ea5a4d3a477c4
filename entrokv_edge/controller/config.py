"""The settings a user gives the controller, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("page-entrokv", "mean-pool", "max-pool", "head-independent", "no-isolation", "streaming", "full")


@dataclass(frozen=True)
class EvictionConfig:
    """Page-EntroKV settings (see ../shared/design/page-entrokv.md).

    budget     : tokens per group buffer (int >= 1) or a fraction of the prompt (0 < float <= 1);
                 rounded down to whole pages
    page_size  : P, tokens per page
    window     : w, observation window (last w prompt tokens)
    sinks      : s, leading positions isolated as attention sinks and always kept
    recent     : rho, trailing tokens always kept (None: = window); must be >= window
    tau        : temperature of the entropy weights
    policy     : one of POLICIES
    page_score : "sum" (attention mass of the page) or "max"
    """

    budget: float | int = 0.2
    page_size: int = 16
    window: int = 32
    sinks: int = 4
    recent: int | None = None
    tau: float = 1.0
    policy: str = "page-entrokv"
    page_score: str = "sum"

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"EvictionConfig: {msg}")

        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            bad(f"budget must be a token count or a fraction, got {self.budget!r}")
        if isinstance(self.budget, float) and not (0.0 < self.budget <= 1.0):
            bad(f"a fractional budget must be in (0, 1], got {self.budget}")
        if isinstance(self.budget, int) and self.budget < 1:
            bad(f"a token budget must be >= 1, got {self.budget}")
        for name in ("page_size", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                bad(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            bad(f"sinks must be an integer >= 0, got {self.sinks!r}")
        if self.recent is not None and (not isinstance(self.recent, int) or self.recent < self.window):
            bad(f"recent must be an integer >= window ({self.window}), got {self.recent!r}")
        if not (isinstance(self.tau, (int, float)) and self.tau > 0 and math.isfinite(self.tau)):
            bad(f"tau must be a positive number, got {self.tau!r}")
        if self.policy not in POLICIES:
            bad(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
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

    def budget_pages(self, n: int) -> int:
        """N: pages every (layer, group) keeps for a prompt of n tokens (checked)."""
        if self.window > n:
            raise ValueError(f"window w={self.window} is longer than the prompt ({n} tokens)")
        tokens = int(self.budget * n) if isinstance(self.budget, float) else int(self.budget)
        # a budget that covers the prompt keeps all of it, the partial last page included
        N = self.n_pages(n) if tokens >= n else min(tokens // self.page_size, self.n_pages(n))
        need = len(self.protected(n))
        if self.policy != "full" and N < need:
            raise ValueError(
                f"budget of {tokens} tokens = {N} pages of {self.page_size} is smaller than the "
                f"{need} protected pages (sinks {self.sinks}, recent {self.rho}); raise the budget")
        return self.n_pages(n) if self.policy == "full" else N
