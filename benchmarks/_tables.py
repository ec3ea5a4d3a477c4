"""The report's tables and its paired test, shared by report.py and report_chat.py."""
from __future__ import annotations

import math


def sign_test(wins: int, losses: int) -> float:
    """Two-sided sign test p-value (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def _table(head: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]) + "\n"
