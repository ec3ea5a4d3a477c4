"""Random scores and parameters for the C selector, and random observer settings (see fuzzing.py)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import entrokv_edge as ek
from entrokv_edge.bindings import select_pages_native
from entrokv_edge.bindings.native import c_api, context_pointer
from entrokv_edge.bindings.observe import _view
from entrokv_edge.controller import EvictionConfig
from entrokv_edge.controller.policies import select
from fuzzing import INT32, _name
from helpers import feed, make_llm
from llama_cpp import llama_cpp as C


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
        ffi, _ = c_api()

        def on_scores(_ud, s):
            v = _view(s)
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
        ffi, lib = c_api()
        return lib.llama_entrokv_set_observer(context_pointer(self.a), w, self.cb if w else ffi.NULL, ffi.NULL)


def check_observer(t: ObserverTarget, ops, seed: int) -> str:
    """Replay ops on `a` (and the decodes on `b`): a refused window leaves the current one; a
    ubatch of >= window tokens is observed once, with its size, last position and scores that
    are distributions; observing never changes the logits."""
    _, lib = c_api()
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
