"""Random input for the C API: the runner and the strategies and checks that tests/test_fuzz.py
runs a few dozen times each and benchmarks/fuzz.py many more times. This module: compaction and
restore; fuzz_scores.py: the C selector and observation; fuzz_inputs.py: session files and the
command line.

Every check returns the kind of its outcome ("ok", or the refusal's name) and asserts the
promise. A refusal raises the documented error (EntroKVError with the expected name, or
ValueError / TypeError before the native call) and leaves the cache exactly as it was: its
state bytes, true positions and geometry, and the next token's logits. An accepted input
gives what an independent reference gives: compaction = the state rewritten in Python
(helpers.oracle_blob), the C selector = the Python one, observation = what the settings
promise, with logits equal to a context that never observed.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import entrokv_edge as ek
from entrokv_edge.bindings import restore
from helpers import feed, load_blob, make_llm, oracle_blob, state_blob
from llama_cpp import llama_cpp as C

N = 40          # tokens the fuzzed context holds
PROBE = 7       # the token decoded to check that a context still works
INT32 = (-(2**31), 2**31 - 1)


def explore(strategy, check, examples: int, derandomize: bool = True) -> Counter:
    """Run check(*case) on `examples` cases drawn from strategy (derandomized: the same cases on
    every run, no example database); returns the count of each outcome."""
    kinds: Counter = Counter()

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def run(case):
        kinds[check(*case) if isinstance(case, tuple) else check(case)] += 1
    run()
    return kinds


def _name(e: ek.EntroKVError) -> str:
    return e.name.removeprefix("LLAMA_ENTROKV_ERR_")


class Target:
    """A synthetic model's context (F32 cache) holding N tokens; reset() puts it back (memory
    cleared, the saved state loaded) and assert_unchanged() checks it is exactly that state."""

    def __init__(self, path, n_ctx: int = 64):
        self.llm = make_llm(path, n_ctx=n_ctx, type_k="f32", n_threads=1)
        self.toks = [int(t) for t in np.random.default_rng(0).integers(3, 300, N)]
        feed(self.llm, self.toks)
        self.blob, self.geo, self.tp = state_blob(self.llm), ek.geometry(self.llm), ek.true_positions(self.llm)
        self.probe = feed(self.llm, [PROBE])
        self.reset()

    def reset(self) -> None:
        C.llama_memory_clear(self.llm._ctx.memory, True)
        load_blob(self.llm, self.blob, self.toks)

    def assert_unchanged(self) -> None:
        assert state_blob(self.llm) == self.blob
        assert ek.geometry(self.llm) == self.geo
        assert np.array_equal(ek.true_positions(self.llm), self.tp)
        assert np.array_equal(feed(self.llm, [PROBE]), self.probe), "the context no longer decodes as before"


# --- compaction: random keep lists ---------------------------------------------------------

DEFECTS = ("none", "none", "drop", "extend", "dup", "swap", "range", "empty cell", "overflow", "rows", "no cells",
           "too long")


@st.composite
def keep_lists(draw, n_slots: int, kv_size: int):
    """(rows, unordered, as_array): per slot a list of cells - per-slot random subsets of the
    sequence's N cells, equal lengths, ascending (or shuffled with unordered) - with up to
    three defects (unequal lengths, duplicates, disorder, cells out of range or empty, values
    beyond int32, a wrong number of lists, empty lists, more cells than the sequence)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    K = draw(st.integers(1, N))
    unordered = draw(st.booleans())
    rows = [sorted(rng.choice(N, K, replace=False).tolist()) for _ in range(n_slots)]
    if unordered:
        rows = [rng.permutation(r).tolist() for r in rows]
    for defect in draw(st.lists(st.sampled_from(DEFECTS), min_size=1, max_size=3)):
        _apply_defect(defect, rows, rng, kv_size, draw)
    return rows, unordered, draw(st.booleans())


def _apply_defect(defect: str, rows: list, rng, kv_size: int, draw) -> None:
    s = int(rng.integers(len(rows))) if rows else 0
    row = rows[s] if rows else []
    j = int(rng.integers(len(row))) if row else 0
    if defect == "drop" and row:
        row.pop(j)
    elif defect == "extend":
        row.append(int(rng.integers(N)))
    elif defect == "dup" and len(row) > 1:
        row[j] = row[j - 1]
    elif defect == "swap" and len(row) > 1:
        row[j], row[j - 1] = row[j - 1], row[j]
    elif defect == "range" and row:
        row[j] = draw(st.sampled_from([-1, -5, INT32[0], kv_size, kv_size + 3, INT32[1]]))
    elif defect == "empty cell" and row:
        row[j] = int(rng.integers(N, kv_size))
    elif defect == "overflow" and row:
        row[j] = draw(st.sampled_from([2**31, -(2**31) - 1, 2**40, -(2**45)]))
    elif defect == "rows":
        if draw(st.booleans()) and rows:
            rows.pop()
        else:
            rows.append(list(rows[0]) if rows else [0])
    elif defect == "no cells":
        rows[:] = [[] for _ in rows]
    elif defect == "too long":
        rows[:] = [list(range(N + 1)) for _ in rows]


def expected_refusal(rows, n_slots: int, kv_size: int, unordered: bool) -> str | None:
    """The refusal the API promises for these lists (None: accepted), in the header's order of
    checks: values beyond int32 (Python, before the call), the number of lists, equal lengths,
    K in 1..N, then per slot and cell: range, order (or duplicates), a token of the sequence."""
    if any(not INT32[0] <= c <= INT32[1] for r in rows for c in r):
        return "PYTHON"
    if len(rows) != n_slots:
        return "INVALID_ARG"
    K = len(rows[0])
    if any(len(r) != K for r in rows) or not 1 <= K <= N:
        return "LIST_LENGTH"
    for r in rows:
        seen = set()
        for j, c in enumerate(r):
            if not 0 <= c < kv_size:
                return "CELL_RANGE"
            if (c in seen) if unordered else (j > 0 and c <= r[j - 1]):
                return "CELL_ORDER"
            seen.add(c)
            if c >= N:
                return "CELL_NOT_IN_SEQ"
    return None


def check_compact(t: Target, rows, unordered: bool, as_array: bool) -> str:
    t.reset()
    want = expected_refusal(rows, t.geo.n_slots, t.geo.kv_size, unordered)
    same_len = rows and len({len(r) for r in rows}) == 1
    keep = np.array(rows, dtype=np.int64).reshape(len(rows), len(rows[0])) if as_array and same_len else rows
    try:
        ek.compact(t.llm, keep, unordered=unordered)
        got = None
    except ek.EntroKVError as e:
        got = _name(e)
        assert e.message, "a refusal names its reason"
    except (ValueError, TypeError):
        got = "PYTHON"
    assert got == want, f"{got} where {want} was due, for {rows} (unordered={unordered})"
    if got is not None:
        t.assert_unchanged()
        return got
    sel = np.array(rows, dtype=np.int32)
    assert state_blob(t.llm) == oracle_blob(t.blob, t.geo, sel), "compaction differs from the state rewrite"
    tp = ek.true_positions(t.llm)
    assert np.array_equal(tp[:, : sel.shape[1]], sel) and (tp[:, sel.shape[1]:] == -1).all()
    return "ok"


# --- restoring a compacted layout: random true-position tables -------------------------------

@st.composite
def restore_tables(draw, n_slots: int):
    """A true-position table [rows, K] for llama_entrokv_restore on the fresh N-token cache (cell j
    holds position j): ascending positions <= j per slot, or with a defect (a wrong number of
    rows, K = 0 or beyond the sequence, negative, too large, unsorted or repeated values)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    K = draw(st.integers(1, N))
    tp = np.stack([np.sort(rng.choice(K, K, replace=False)) for _ in range(n_slots)]).astype(np.int64)
    defect = draw(st.sampled_from(["none", "none", "rows", "no cells", "too long", "negative", "too large",
                                   "unsorted", "repeated", "1-D"]))
    s, j = int(rng.integers(n_slots)), int(rng.integers(K))
    if defect == "rows":
        tp = tp[:-1] if draw(st.booleans()) else np.concatenate([tp, tp[:1]])
    elif defect == "no cells":
        tp = tp[:, :0]
    elif defect == "too long":
        tp = np.tile(np.arange(N + 1), (n_slots, 1))
    elif defect == "negative":
        tp[s, j] = -1 - int(rng.integers(3))
    elif defect == "too large":
        tp[s, j] = j + 1 + int(rng.integers(N))
    elif defect in ("unsorted", "repeated") and K > 1:
        j = max(j, 1)
        tp[s, j] = tp[s, j - 1] - (1 if defect == "unsorted" else 0)
    elif defect == "1-D":
        tp = tp[0]
    return tp


def expected_restore(tp: np.ndarray, n_slots: int, kv_size: int) -> str | None:
    """The refusal llama_entrokv_restore promises on a cache whose cell j holds position j < N."""
    if tp.ndim != 2:
        return "PYTHON"
    K = tp.shape[1]
    if not 1 <= K <= kv_size or tp.shape[0] != n_slots:
        return "INVALID_ARG"
    if K > N:
        return "CELL_NOT_IN_SEQ"
    bad = (tp < 0) | (tp > np.arange(K)) | np.concatenate([np.zeros((n_slots, 1), bool), np.diff(tp) <= 0], 1)
    return "CELL_ORDER" if bad.any() else None


def check_restore(t: Target, tp: np.ndarray) -> str:
    t.reset()
    want = expected_restore(tp, t.geo.n_slots, t.geo.kv_size)
    try:
        restore(t.llm, tp)
        got = None
    except ek.EntroKVError as e:
        got = _name(e)
    except ValueError:
        got = "PYTHON"
    assert got == want, f"{got} where {want} was due"
    if got is not None:
        t.assert_unchanged()
        return got
    K = tp.shape[1]
    assert np.array_equal(ek.true_positions(t.llm)[:, :K], tp) and ek.geometry(t.llm).n_compacted == K
    assert state_blob(t.llm) == t.blob, "restore changed the cache's data"
    return "ok"
