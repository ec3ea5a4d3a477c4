"""The controller: what an eviction keeps, decided from scores alone (numpy; nothing here touches a model).

config.py (the settings), stats.py and weights.py (per-head statistics, entropy weights), scoring.py (scores
smoothed, pooled, voted), pages.py (pages and the exact-budget selection), policies.py (scorers, selections,
wrappers), metrics.py (union overhead and disagreement)."""
from .config import METHOD_POLICIES, POLICIES, EvictionConfig
from .policies import (EntropyScorer, ExactBudget, Favour, FullCache, GroupMax, HeadIndependent, Policy, Protect,
                       Recency, Scorer, Selection, Wrapper, policy_for, select, select_layers)

__all__ = ["METHOD_POLICIES", "POLICIES", "EntropyScorer", "EvictionConfig", "ExactBudget", "Favour", "FullCache",
           "GroupMax", "HeadIndependent", "Policy", "Protect", "Recency", "Scorer", "Selection", "Wrapper",
           "policy_for", "select", "select_layers"]
