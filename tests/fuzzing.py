"""Random input for the C API: the strategies and the checks that tests/test_fuzz.py runs a
few dozen times each and benchmarks/fuzz.py many more times.

Every check returns the kind of its outcome ("ok", or the refusal's name) and asserts the
promise. A refusal raises the documented error (EntroKVError with the expected name, or
ValueError / TypeError before the native call) and leaves the cache exactly as it was: its
state bytes, true positions and geometry, and the next token's logits. An accepted input
gives what an independent reference gives: compaction = the state rewritten in Python
(helpers.oracle_blob), the C selector = the Python one, observation = what the settings
promise, with logits equal to a context that never observed.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import entrokv_edge as ek
from entrokv_edge.bindings import restore, select_pages_native
from entrokv_edge.bindings.native import _api, context_pointer
from entrokv_edge.bindings.observe import _view
from entrokv_edge.controller import EvictionConfig
from entrokv_edge.controller.policies import select
from entrokv_edge.runtime import session
from helpers import feed, load_blob, logits, make_llm, oracle_blob, state_blob
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


# --- the C selector: random scores and parameters ---------------------------------------------

SPECIALS = (np.nan, np.inf, -np.inf, -1e-3, -0.0, 0.0, np.finfo(np.float32).max)
BAD_PARAMS = {"page_size": [0, -3], "sinks": [-1], "recent": [0, -2], "tau": [0.0, -1.0, np.nan, np.inf],
              "budget": [0, -5], "heads": [0, -1], "int32": [2**31, 2**40]}


@st.composite
def selector_cases(draw) -> dict:
    """Shapes, parameters (sometimes one bad) and a kind of scores: Dirichlet rows, some heads
    all zero, small integers (many ties), tiny (float32 denormal) values, or Dirichlet rows with
    special values (NaN, +-inf, negatives, -0.0, float32's max)."""
    G, r = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3, 4]))
    n = draw(st.integers(1, 160))
    return dict(L=draw(st.integers(1, 3)), G=G, r=r, n=n, P=draw(st.integers(1, 24)), sinks=draw(st.integers(0, 12)),
                recent=draw(st.integers(1, 48)), budget=draw(st.integers(1, n + 32)),
                tau=draw(st.sampled_from([0.25, 1.0, 3.0])), page_max=draw(st.booleans()),
                kind=draw(st.sampled_from(["dirichlet", "zero heads", "integers", "tiny", "special"])),
                bad=draw(st.sampled_from([None] * 10 + list(BAD_PARAMS))), bad_i=draw(st.integers(0, 3)),
                seed=draw(st.integers(0, 2**32 - 1)))


def selector_scores(c: dict) -> np.ndarray:
    rng = np.random.default_rng(c["seed"])
    L, H, n = c["L"], c["G"] * c["r"], c["n"]
    s = rng.dirichlet(np.full(n, 0.3), size=(L, H)).astype(np.float32)
    if c["kind"] == "zero heads":
        s[rng.random((L, H)) < 0.4] = 0.0
    elif c["kind"] == "integers":
        s = rng.integers(0, 4, (L, H, n)).astype(np.float32)
    elif c["kind"] == "tiny":
        s = (s * np.float32(1e-38)).astype(np.float32)
    elif c["kind"] == "special":
        idx = rng.integers(0, s.size, int(rng.integers(1, 4)))
        s.flat[idx] = rng.choice(np.array(SPECIALS, dtype=np.float32), idx.size)
    return s


def _selector_args(c: dict) -> dict:
    a = dict(budget=c["budget"], page_size=c["P"], sinks=c["sinks"], recent=c["recent"], tau=c["tau"],
             page_max=c["page_max"], G=c["G"])
    bad = c["bad"]
    if bad is not None:
        v = BAD_PARAMS[bad][c["bad_i"] % len(BAD_PARAMS[bad])]
        a[{"heads": "G", "int32": "budget"}.get(bad, bad)] = v
    return a


def expected_selection(c: dict, a: dict, s: np.ndarray) -> tuple[str, int, list[int]]:
    """("ok", N, protected pages) or the refusal: bad parameters or scores that are not attention
    weights (INVALID_ARG), values beyond int32 (PYTHON), a budget below the protected pages."""
    if c["bad"] == "int32":
        return "PYTHON", 0, []
    H, n, P = c["G"] * c["r"], c["n"], a["page_size"]
    if c["bad"] is not None or a["G"] < 1 or H % a["G"]:
        return "INVALID_ARG", 0, []
    if not (np.isfinite(s).all() and (s >= 0).all()):
        return "INVALID_ARG", 0, []
    n_pages = -(-n // P)
    prot = sorted(set(range(-(-min(a["sinks"], n) // P))) | set(range(max(0, n_pages - -(-a["recent"] // P)), n_pages)))
    N = n_pages if a["budget"] >= n else min(a["budget"] // P, n_pages)
    return ("LIST_LENGTH", N, prot) if N < len(prot) else ("ok", N, prot)


def _python_selection(c: dict, a: dict, s: np.ndarray, N: int) -> np.ndarray:
    cfg = EvictionConfig(budget=10**9, page_size=a["page_size"], window=1, sinks=a["sinks"], recent=a["recent"],
                         tau=a["tau"], page_score="max" if a["page_max"] else "sum", policy="page-entrokv")
    return select(s.astype(np.float64), c["r"], cfg, c["n"], n_keep=N).pages


def check_selector(c: dict) -> str:
    s = selector_scores(c)
    a = _selector_args(c)
    want, N, prot = expected_selection(c, a, s)
    G = a.pop("G")
    try:
        pages = select_pages_native(s, G, **a)
        got = "ok"
    except ek.EntroKVError as e:
        got = _name(e)
    except (ValueError, TypeError):
        got = "PYTHON"
    assert got == want, f"{got} where {want} was due ({c})"
    if c["kind"] == "special" and c["bad"] is None and want == "INVALID_ARG":   # the Python selector refuses them too
        try:
            _python_selection(c, {**a, "G": G}, s, 1)
            raise AssertionError("the Python selector took scores the C one refuses")
        except ValueError:
            pass
    if got != "ok":
        return got
    L = c["L"]
    assert pages.shape == (L, G, N) and (np.diff(pages, axis=-1) > 0).all() and pages.min() >= 0
    assert pages.max() < -(-c["n"] // a["page_size"])
    for row in pages.reshape(-1, N):
        assert set(prot) <= set(row.tolist())
    exact_ties = c["kind"] == "integers" and c["r"] > 1     # rounding may order ties of sums differently
    if not exact_ties:
        assert np.array_equal(pages, _python_selection(c, {**a, "G": G}, s, N)), "C and Python selectors differ"
    return "ok"


# --- observation: random windows, start / stop, decodes -------------------------------------

@st.composite
def observer_ops(draw):
    """A few operations: set a window (any int, within int32 or not; 0 stops), stop, decode T tokens."""
    window = st.one_of(st.integers(-3, 30), st.sampled_from([INT32[0], INT32[1], 2**31, 2**40, 256, 257, 300]))
    op = st.one_of(st.tuples(st.just("window"), window), st.tuples(st.just("stop"), st.just(0)),
                   st.tuples(st.just("decode"), st.integers(1, 24)))
    return draw(st.lists(op, min_size=1, max_size=8)), draw(st.integers(0, 2**16))


class ObserverTarget:
    """Two contexts of one synthetic model: `a` observes as the operations say, `b` never."""

    def __init__(self, path, n_ctx: int = 64):
        self.a, self.b = make_llm(path, n_ctx=n_ctx, n_threads=1), make_llm(path, n_ctx=n_ctx, n_threads=1)
        self.n_ubatch = n_ctx
        self.seen: list[tuple] = []
        ffi, _ = _api()

        def on_scores(_ud, s):
            v = _view(ffi, s)
            sums = v.scores.sum(-1, dtype=np.float64)
            self.seen.append((v.window, v.n_tokens, v.pos_last, bool(np.allclose(sums, 1.0, atol=1e-4)),
                              bool((v.scores >= 0).all())))

        self.cb = ffi.callback("void(void *, const struct llama_entrokv_scores *)", on_scores)

    def reset(self) -> None:
        for llm in (self.a, self.b):
            C.llama_memory_clear(llm._ctx.memory, True)
            llm.n_tokens = 0
        self.set_window(0)
        self.seen.clear()

    def set_window(self, w: int) -> int:
        ffi, lib = _api()
        return lib.llama_entrokv_set_observer(context_pointer(self.a), w, self.cb if w else ffi.NULL, ffi.NULL)


def check_observer(t: ObserverTarget, ops, seed: int) -> str:
    """Replay ops on `a` (and the decodes on `b`): a refused window leaves the current one; a
    ubatch of >= window tokens is observed once, with its size, last position and scores that
    are distributions; observing never changes the logits."""
    _, lib = _api()
    t.reset()
    rng = np.random.default_rng(seed)
    active, want, kinds = 0, [], []
    for op, arg in ops:
        if op == "decode":
            toks = rng.integers(3, 300, arg)
            pos = t.a.n_tokens
            assert np.array_equal(feed(t.a, toks), feed(t.b, toks)), "observing changed the logits"
            if active and arg >= active:
                want.append((active, arg, pos + arg - 1, True, True))
            assert t.seen == want
            continue
        w = 0 if op == "stop" else arg
        if not INT32[0] <= w <= INT32[1]:
            try:
                ek.Observation(t.a, w)
                raise AssertionError(f"Observation took window {w}")
            except ValueError:
                kinds.append("PYTHON")
            continue
        rc = t.set_window(w)
        due = lib.LLAMA_ENTROKV_ERR_INVALID_ARG if w < 0 or w > t.n_ubatch else 0
        assert rc == due, f"set_observer({w}) returned {rc}, {due} was due"
        kinds.append("ok" if rc == 0 else "INVALID_ARG")
        if rc == 0:
            active = w
    t.reset()
    return "+".join(sorted(set(kinds))) or "decodes"


# --- session files: random damage, and states re-signed after a change ----------------------

SESSION_SETTINGS = dict(budget=64, page_size=8, window=16, verbose=False, seed=0, n_threads=1, n_threads_batch=1)
ZIP_MARKS = re.compile(rb"PK\x03\x04|PK\x01\x02|PK\x05\x06|\x93NUMPY")


class SessionTarget:
    """A compacted conversation `a` saved to a file, and a second context `b` in the middle of its
    own, whose state every check puts back."""

    def __init__(self, path, tmp: Path):
        self.tmp = tmp
        self.a = ek.EntroKVLlama(str(path), n_ctx=256, **SESSION_SETTINGS)
        self.a.eval([int(t) for t in np.random.default_rng(1).integers(3, 300, 600)])
        self.file = tmp / "chat.entrokv"
        self.a.save_session(self.file)
        self.data = self.file.read_bytes()
        self.marks = [m.start() for m in ZIP_MARKS.finditer(self.data)]
        self.b = ek.EntroKVLlama(str(path), n_ctx=256, **SESSION_SETTINGS)
        self.b.eval([int(t) for t in np.random.default_rng(2).integers(3, 300, 300)])
        self.b_state = self.b.save_state()
        self.b_now = (logits(self.b), ek.true_positions(self.b), self.b.n_tokens)
        self.b.eval([PROBE])
        self.b_next = logits(self.b)
        self.b.load_state(self.b_state)

    def assert_b_unchanged(self) -> None:
        lg, tp, n = self.b_now
        assert self.b.n_tokens == n and np.array_equal(ek.true_positions(self.b), tp)
        assert np.array_equal(logits(self.b), lg)
        self.b.eval([PROBE])
        assert np.array_equal(logits(self.b), self.b_next), "the context no longer decodes as before"

    def load(self, file: Path) -> str:
        """Load file into b: a SessionError must leave b as it was; a load must give a's state."""
        try:
            try:
                self.b.load_session(file)
                got = "loaded"
            except ek.SessionError:
                got = "SessionError"
            if got == "loaded":
                assert self.b.n_tokens == self.a.n_tokens and np.array_equal(logits(self.b), logits(self.a))
                assert np.array_equal(ek.true_positions(self.b), ek.true_positions(self.a))
            else:
                self.assert_b_unchanged()
        finally:
            self.b.load_state(self.b_state)
        return got


@st.composite
def damaged_files(draw, data: bytes, marks: list):
    """The file with bits flipped (anywhere, or in a zip or .npy header), cut short, with bytes
    appended or zeroed, or replaced by random bytes."""
    kind = draw(st.sampled_from(["flip", "flip header", "truncate", "append", "zero", "random"]))
    b = bytearray(data)
    if kind in ("flip", "flip header"):
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.integers(0, len(b) - 1)) if kind == "flip" else \
                min(len(b) - 1, draw(st.sampled_from(marks)) + draw(st.integers(0, 120)))
            b[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        del b[draw(st.integers(0, len(b) - 1)):]
    elif kind == "append":
        b += draw(st.binary(min_size=1, max_size=64))
    elif kind == "zero":
        at = draw(st.integers(0, len(b) - 1))
        b[at: at + draw(st.integers(1, 512))] = bytes(min(len(b) - at, 512))[: len(b[at: at + 512])]
    else:
        b = bytearray(draw(st.binary(max_size=512)))
    return kind, bytes(b)


def check_damaged(t: SessionTarget, kind: str, data: bytes) -> str:
    f = t.tmp / "damaged.entrokv"
    f.write_bytes(data)
    return f"{kind}: {t.load(f)}"


RESIGNED = ("n_tokens short", "n_tokens long", "token ids", "true_pos values", "true_pos shape", "logits size",
            "window scores shape", "window scores values", "window scores position", "settings", "identity",
            "llama_state cut")


def _resign(st_, defect: str, rng) -> None:
    """Change one field of a state the way no save of ours would (the file is then re-signed)."""
    k = int(rng.integers(1, 20))
    ws = st_.window_scores
    if defect == "n_tokens short":
        st_.n_tokens -= k
        st_.input_ids = st_.input_ids[: st_.n_tokens]
    elif defect == "n_tokens long":
        st_.n_tokens += k
        st_.input_ids = np.concatenate([st_.input_ids, rng.integers(3, 300, k).astype(np.int32)])
    elif defect == "token ids":
        st_.input_ids = st_.input_ids.copy()
        st_.input_ids[rng.integers(st_.input_ids.size)] = rng.choice([-1, 10**6, 2**31 - 1])
    elif defect == "true_pos values":
        st_.true_pos = rng.integers(-5, 10**4, st_.true_pos.shape).astype(np.int32)
    elif defect == "true_pos shape":
        st_.true_pos = np.zeros((st_.true_pos.shape[0] + 1, 3), np.int32)
    elif defect == "logits size":
        st_.logits = st_.logits[:-k]
    elif defect == "window scores shape":
        ws.scores = ws.scores[:, :-1]
    elif defect == "window scores values":
        ws.scores = ws.scores.copy()
        ws.scores.flat[rng.integers(ws.scores.size)] = rng.choice([np.nan, np.inf, -1.0])
    elif defect == "window scores position":
        ws.pos_last = st_.n_tokens + k
    elif defect == "settings":
        st_.settings = {**st_.settings, "budget": -k}
    elif defect == "identity":
        st_.identity = {**st_.identity, "model": "0" * 64}
    elif defect == "llama_state cut":
        st_.llama_state = st_.llama_state[: -k * 100]


def check_resigned(t: SessionTarget, defect: str, seed: int) -> str:
    """A well-formed file (checksums right) whose content does not fit: refused, b unchanged."""
    st_ = session.read(t.file)
    _resign(st_, defect, np.random.default_rng(seed))
    f = t.tmp / "resigned.entrokv"
    session.write(f, st_)
    got = t.load(f)
    assert got == "SessionError", f"a re-signed state with {defect} was loaded"
    return defect


# --- the command line: random arguments and input files, in-process --------------------------

VALUES = ["0", "1", "2", "3", "16", "32", "64", "-1", "-7", "0.2", "1.0", "1.5", "-0.5", "1e-9", "nan", "inf", "-inf",
          "1e400", "2147483648", "99999999999999999999", "-99999999999", "abc", "", "0x10", "\u00e9"]
OPTIONS = {"--kv-cells": VALUES, "--budget": VALUES, "--page-size": VALUES, "--window": VALUES, "--sinks": VALUES,
           "--recent": VALUES, "--tau": VALUES, "--pool": VALUES, "--spread": VALUES, "--decay": VALUES,
           "--value-power": VALUES, "--lookahead": VALUES, "--lookahead-share": VALUES, "--consensus": VALUES,
           "--threads": VALUES + ["513", "100000"], "--max-tokens": ["1", "2", "4", "0", "-3", "10**12"],
           "--temp": VALUES, "--n-gpu-layers": ["0", "-1", "5"], "--policy": ["page-entrokv", "streaming", "best"],
           "--entropy-region": ["sinks", "evictable", "none"], "--head-pool": ["rank", "max", "sum"]}
FILES = {"empty": b"", "blank": b" \n\t\n", "binary": bytes(range(256)), "latin-1": "caf\u00e9 cr\u00e8me".encode("latin-1"),
         "text": b"the quick brown fox jumps over the lazy dog. " * 8, "long": b"abc def ghi jkl " * 400}


class CLIFiles:
    """A synthetic model with a short context (256 tokens, so that an unlimited answer ends soon),
    the input files above, a file that is not a model."""

    def __init__(self, tmp: Path):
        from synth import write_model
        self.model = write_model(tmp / "cli.gguf", n_ctx_train=256, seed=11)
        self.files = {}
        for name, data in FILES.items():
            (tmp / name).write_bytes(data)
            self.files[name] = str(tmp / name)
        self.files["missing"] = str(tmp / "nope.txt")
        self.files["directory"] = str(tmp)
        (tmp / "notgguf.gguf").write_text("hello")
        self.models = {"synthetic": str(self.model), "not gguf": str(tmp / "notgguf.gguf"),
                       "missing": str(tmp / "none.gguf"), "unknown name": "no-such-model"}


@st.composite
def cli_args(draw, t: CLIFiles):
    """argv for `entrokv-edge run|inspect|chat` (and a stdin for chat): mostly the synthetic model,
    a prompt and/or a file, then up to four options with random values."""
    cmd = draw(st.sampled_from(["run", "run", "run", "inspect", "chat"]))
    model = draw(st.sampled_from(["synthetic"] * 6 + list(t.models)))
    argv = [cmd, "-m", t.models[model]]
    if cmd != "chat":
        if draw(st.booleans()):
            argv += ["-f", t.files[draw(st.sampled_from(sorted(t.files)))]]
        argv += ["-p", draw(st.sampled_from(["a short question?", "", "   ", "x" * 3, "\u00fcber"]))]
    opts = draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=4, unique=True))
    for opt in opts:
        argv.append(f"{opt}={draw(st.sampled_from(OPTIONS[opt]))}")
    if draw(st.booleans()):        # settings a short prompt on this model accepts, unless drawn above
        argv += [f"{k}={v}" for k, v in (("--window", 4), ("--budget", 0.5), ("--page-size", 2)) if k not in opts]
    if "--max-tokens" not in opts and cmd != "inspect":
        argv.append("--max-tokens=2")
    return argv, draw(st.sampled_from(["hello\n/quit\n", "", "/stats\n/bogus\n/load /nonexistent\n"]))


def _refusal_kind(line: str) -> str:
    msg = re.sub(r"/\S+", "PATH", line.removeprefix("entrokv-edge: "))
    if msg.startswith("argument "):
        return "usage: " + msg.split(":")[0].removeprefix("argument ")
    return "refused: " + " ".join(re.sub(r"\S*\d\S*", "N", msg).split()[:4])


def check_cli(argv: list, stdin: str) -> str:
    """main(argv) in this process: exit status 0, or 2 with one line on stderr ('entrokv-edge: ...')
    and nothing on stdout; any exception is a failure (it would be a traceback)."""
    import contextlib
    import io
    import sys
    from entrokv_edge import cli
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:
                rc = e.code
    finally:
        sys.stdin = old_stdin
    text = err.getvalue()
    assert "Traceback" not in text, text
    if rc == 0:
        return "ok"
    lines = text.strip().splitlines()
    if argv[0] == "chat" and lines and lines[0].startswith("entrokv-edge chat:"):
        lines = lines[1:]                      # the chat's greeting, before its refusal
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("entrokv-edge: "), (argv, rc, text)
    assert out.getvalue() == "", (argv, out.getvalue())
    return _refusal_kind(lines[0])
