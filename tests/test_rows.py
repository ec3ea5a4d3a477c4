"""Rows of single (slot, cell) pairs in and out of the cache (llama_entrokv_read_cells /
_write_cells), against the serialized state rewritten in Python, on synthetic models."""
import numpy as np
import pytest

import entrokv_edge as ek
from entrokv_edge.bindings import read_cells, restore, swap_cells, write_cells
from helpers import feed, make_llm, oracle_blob, parse_cache, random_keep, state_blob

N, K = 48, 20
CACHE_CONFIGS = [       # (type_k, type_v, flash_attn): V quantization needs flash attention
    ("f32", "f32", False),
    ("f16", "f16", False),
    ("f16", "f16", True),
    ("q8_0", "q8_0", True),
    ("q4_0", "f16", False),
]


def filled(path, seed=4, **kw):
    llm = make_llm(path, **kw)
    feed(llm, np.random.default_rng(seed).integers(3, 300, N))
    return llm


def blob_rows(blob: bytes, g, s: int, cells) -> tuple[np.ndarray, np.ndarray]:
    """Slot s's K and V rows of the blob's cells, read from the serialized state."""
    c = parse_cache(blob)
    li = next(i for i, l in enumerate(g.layers) if l.slot0 <= s < l.slot0 + l.n_head_kv)
    h, nh = s - g.layers[li].slot0, g.layers[li].n_head_kv
    _, row, data = c.k[li]
    k = data[cells, h * row // nh:(h + 1) * row // nh]
    if not c.v_trans:
        _, row, data = c.v[li]
        return k, data[cells, h * row // nh:(h + 1) * row // nh]
    _, el, ne, data = c.v[li]
    hd = ne // nh
    return k, data[h * hd:(h + 1) * hd][:, cells, :].transpose(1, 0, 2).reshape(len(cells), hd * el)


@pytest.mark.parametrize("type_k,type_v,fa", CACHE_CONFIGS)
@pytest.mark.parametrize("model", ["llama-r3", "qwen2-r2"])
def test_read_cells_match_the_serialized_state(synth_models, model, type_k, type_v, fa):
    llm = filled(synth_models[model], type_k=type_k, type_v=type_v, flash_attn=fa)
    g = ek.geometry(llm)
    rng = np.random.default_rng(1)
    # unequal lists, runs and scattered cells, one empty list
    cells = [np.sort(rng.choice(N, int(rng.integers(1, 30)), replace=False)) for _ in range(g.n_slots)]
    cells[1] = np.zeros(0, np.int32)
    blob = state_blob(llm)
    k, v = read_cells(llm, cells)
    for s in range(g.n_slots):
        kr, vr = blob_rows(blob, g, s, cells[s])
        assert np.array_equal(k[s], kr) and np.array_equal(v[s], vr), f"slot {s}"
    ko, vo = read_cells(llm, cells, keys_only=True)              # no V buffer: the same keys, no V read
    assert vo is None and all(np.array_equal(a, b) for a, b in zip(ko, k))
    assert state_blob(llm) == blob, "reading changed the cache"


def swap_plan(rng, keep: np.ndarray, n_swap: int, protect: int):
    """Per slot: cells of the compacted layout to overwrite (not the protected last ones) and
    evicted positions to put there; some slots swap nothing."""
    cells, pos = [], []
    for s, kept in enumerate(keep):
        m = 0 if s % 3 == 2 else n_swap
        evicted = np.setdiff1d(np.arange(N), kept)
        cells.append(rng.choice(K - protect, m, replace=False).astype(np.int32))   # any order
        pos.append(rng.choice(evicted, m, replace=False).astype(np.int32))
    return cells, pos


@pytest.mark.parametrize("type_k,type_v,fa", CACHE_CONFIGS)
def test_written_cells_match_the_state_rewrite_oracle(synth_models, type_k, type_v, fa):
    path = synth_models["llama-r3"]
    a = filled(path, type_k=type_k, type_v=type_v, flash_attn=fa)
    g = ek.geometry(a)
    full = state_blob(a)
    store_k, store_v = read_cells(a, [np.arange(N)] * g.n_slots)       # every token's rows, before eviction
    rng = np.random.default_rng(5)
    keep = random_keep(rng, g.n_slots, N, K, protect=4)
    ek.compact(a, keep)
    cells, pos = swap_plan(rng, keep, 6, protect=4)
    write_cells(a, cells, pos, [store_k[s][pos[s]] for s in range(g.n_slots)],
                [store_v[s][pos[s]] for s in range(g.n_slots)])
    want = keep.copy()
    for s in range(g.n_slots):
        want[s, cells[s]] = pos[s]
    assert (ek.true_positions(a)[:, :K] == want).all()
    assert state_blob(a) == oracle_blob(full, g, want), "the written cache differs from the Python rewrite"
    # a twin loaded from the oracle, with the same (no longer ascending) true positions, decodes the same
    b = make_llm(path, type_k=type_k, type_v=type_v, flash_attn=fa)
    from helpers import load_blob
    load_blob(b, oracle_blob(full, g, want), range(N))
    restore(b, want)
    for t in (7, 123, 42):
        assert np.array_equal(feed(a, [t]), feed(b, [t]))
    # a later compaction composes the written true positions
    keep2 = np.sort(np.stack([rng.choice(K + 3, K - 6, replace=False) for _ in range(g.n_slots)]), 1).astype(np.int32)
    tp = ek.true_positions(a)
    ek.compact(a, keep2)
    assert (ek.true_positions(a)[:, :K - 6] == np.take_along_axis(tp, keep2, 1)).all()


@pytest.mark.parametrize("type_k,type_v,fa", CACHE_CONFIGS)
def test_swapped_cells_give_what_a_read_then_a_write_give(synth_models, type_k, type_v, fa):
    """swap_cells (llama_entrokv_swap_cells): the rows it hands back are the ones read_cells reads just
    before, and the cache and true positions after it are the ones write_cells leaves, on every cache
    layout (transposed V or not, F32, F16, quantized)."""
    path = synth_models["llama-r3"]
    a, b = (filled(path, type_k=type_k, type_v=type_v, flash_attn=fa) for _ in range(2))
    g = ek.geometry(a)
    store_k, store_v = read_cells(a, [np.arange(N)] * g.n_slots)
    rng = np.random.default_rng(6)
    keep = random_keep(rng, g.n_slots, N, K, protect=4)
    ek.compact(a, keep), ek.compact(b, keep)
    for n_swap in (6, 3):                       # twice: the second swaps cells the first wrote
        cells, pos = swap_plan(rng, keep, n_swap, protect=4)
        tp = ek.true_positions(a)
        pos = [np.setdiff1d(p, t) for p, t in zip(pos, tp)]              # not held already
        cells = [c[: p.size] for c, p in zip(cells, pos)]
        k_in = [store_k[s][pos[s]] for s in range(g.n_slots)]
        v_in = [store_v[s][pos[s]] for s in range(g.n_slots)]
        want_k, want_v = read_cells(b, cells, g, buffers=True)
        write_cells(b, cells, pos, k_in, v_in, g)
        got_k, got_v = swap_cells(a, cells, pos, k_in, v_in, g)
        assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
        assert (ek.true_positions(a) == ek.true_positions(b)).all()
        assert state_blob(a) == state_blob(b)


def test_refused_writes_leave_the_cache_and_table_untouched(synth_models):
    a = filled(synth_models["llama-r2"], type_k="f32")
    g = ek.geometry(a)
    ns = g.n_slots
    store_k, store_v = read_cells(a, [np.arange(N)] * ns)
    with pytest.raises(ek.EntroKVError, match="no compacted cell"):       # never compacted
        write_cells(a, [[0]] * ns, [[1]] * ns, [store_k[s][[1]] for s in range(ns)], [store_v[s][[1]] for s in range(ns)])
    keep = random_keep(np.random.default_rng(2), ns, N, K, protect=4)
    ek.compact(a, keep)
    feed(a, [9, 10])                                   # two cells after the compacted ones
    blob, tp = state_blob(a), ek.true_positions(a)
    evicted = [np.setdiff1d(np.arange(N), kept)[:2] for kept in keep]

    def rows(p):
        return [store_k[s][p[s]] for s in range(ns)], [store_v[s][p[s]] for s in range(ns)]

    cases = [
        ([[0, K]] * ns, evicted, "CELL_RANGE"),                         # a cell after the compacted ones
        ([[0, 0]] * ns, evicted, "CELL_ORDER"),                         # a cell twice
        ([[0, 1]] * ns, [np.array([e[0], e[0]]) for e in evicted], "CELL_ORDER"),     # a position twice
        ([[0, 1]] * ns, [np.array([e[0], kept[5]]) for e, kept in zip(evicted, keep)], "CELL_ORDER"),  # held elsewhere
        ([[0, 1]] * ns, [np.array([e[0], N + 1]) for e in evicted], "INVALID_ARG"),   # after the compacted positions
        ([[0, 1]] * ns, [np.array([e[0], -1]) for e in evicted], "INVALID_ARG"),
        ([[0, 5000]] * ns, evicted, "CELL_RANGE"),
    ]
    for cells, pos, name in cases:
        k, v = rows([np.clip(p, 0, N - 1) for p in pos])
        for call in (write_cells, swap_cells):
            with pytest.raises(ek.EntroKVError) as e:
                call(a, cells, pos, k, v)
            assert e.value.name == f"LLAMA_ENTROKV_ERR_{name}", (call, cells[0], pos[0], e.value)
            assert state_blob(a) == blob and (ek.true_positions(a) == tp).all()
    k, v = rows(evicted)
    for call in (write_cells, swap_cells):
        with pytest.raises(ek.EntroKVError, match="BUFFER_SIZE"):           # rows of the wrong size
            call(a, [[0, 1]] * ns, evicted, [x[:, :-1] for x in k], v)
    with pytest.raises(ValueError, match="cell lists"):
        write_cells(a, [[0, 1]] * (ns - 1), evicted[:-1], k[:-1], v[:-1])
    # a swap without a buffer for the rows it overwrites (the C call directly)
    from entrokv_edge.bindings.native import c_api, context_pointer
    ffi, lib = c_api()
    lens, flat = np.full(ns, 2, np.int32), np.tile(np.array([0, 1], np.int32), ns)
    kk, vv = np.concatenate([x.ravel() for x in k]), np.concatenate([x.ravel() for x in v])
    tpos = np.concatenate(evicted).astype(np.int32)
    kold = np.zeros_like(kk)
    for ko, vo in ((ffi.NULL, ffi.NULL), (ffi.from_buffer("char[]", kold), ffi.NULL)):
        rc = lib.llama_entrokv_swap_cells(context_pointer(a), ns, ffi.from_buffer("int32_t[]", lens),
                                          ffi.from_buffer("int32_t[]", flat), ffi.from_buffer("int32_t[]", tpos),
                                          ffi.from_buffer("char[]", kk), kk.size, ffi.from_buffer("char[]", vv), vv.size,
                                          ko, vo)
        assert rc == lib.LLAMA_ENTROKV_ERR_INVALID_ARG and not kold.any()
    assert state_blob(a) == blob and (ek.true_positions(a) == tp).all()
    # the same rows into the right cells are taken: the cases above were refused for their own reason
    write_cells(a, [[0, 1]] * ns, evicted, k, v)
    assert (ek.true_positions(a)[:, :2] == np.stack(evicted)).all()


def test_read_refuses_empty_cells_and_bad_lists(synth_models):
    a = filled(synth_models["llama-r2"])
    ns = ek.geometry(a).n_slots
    with pytest.raises(ek.EntroKVError, match="holds no token"):
        read_cells(a, [[N]] * ns)
    with pytest.raises(ek.EntroKVError, match="CELL_RANGE"):
        read_cells(a, [[-1]] * ns)
    with pytest.raises(TypeError):
        read_cells(a, [[0.5]] * ns)



def test_rows_given_flat_write_what_per_slot_lists_write(synth_models):
    """write_cells' flat form (every slot's positions and rows in turn, as read_cells(buffers=True)
    reads them) writes the same cache as the per-slot lists; a flat form of the wrong length is
    refused with the cache untouched."""
    path = synth_models["llama-r3"]
    rng = np.random.default_rng(8)
    a, b = filled(path, type_k="f16"), filled(path, type_k="f16")
    g = ek.geometry(a)
    keep = random_keep(rng, g.n_slots, N, K, protect=4)
    cells, pos = swap_plan(rng, keep, 5, protect=4)
    fk, fv = read_cells(a, pos, buffers=True)          # before the compaction cell j holds position j
    lk, lv = read_cells(a, pos)
    ek.compact(a, keep), ek.compact(b, keep)
    blob, tp = state_blob(b), ek.true_positions(b)
    flat_pos = np.concatenate(pos)
    with pytest.raises(ValueError, match="one position per listed cell"):
        write_cells(b, cells, flat_pos[:-1], fk, fv)
    with pytest.raises(ek.EntroKVError, match="BUFFER_SIZE"):
        write_cells(b, cells, flat_pos, fk[:-1], fv)
    assert state_blob(b) == blob and (ek.true_positions(b) == tp).all()
    write_cells(a, cells, np.array(pos, dtype=object), lk, lv, g)    # per-slot lists, in an object array too
    write_cells(b, cells, flat_pos, fk, fv, g)
    assert (ek.true_positions(b) == ek.true_positions(a)).all()
    assert state_blob(b) == state_blob(a) != blob


@pytest.mark.parametrize("type_name", ["f32", "f16", "bf16"])
def test_rows_to_float_converts_exact_types_as_ggml_does(type_name):
    """F32 / BF16 rows convert in numpy, F16 in our C (F16C where the CPU has it; the recall's hot path);
    every bit pattern of a 16-bit type, and random F32 words, must give the floats ggml's own conversion
    gives (NaNs as NaNs), and F16 numpy's own cast too (ggml's F16 call is ours)."""
    from entrokv_edge.bindings.rows import _ggml_to_float, rows_to_float
    if type_name == "f32":
        words = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
        words[:4] = [0, 0x80000000, 0x7F800000, 0x00000001]          # zeros, inf, a subnormal
        rows = words.view(np.uint8).reshape(64, -1)
    else:
        rows = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.uint8).reshape(512, -1)
    tid = {"f32": 0, "f16": 1, "bf16": 30}[type_name]
    got, want = rows_to_float(rows, type_name), _ggml_to_float(rows, tid)
    if type_name == "f16":
        want = rows.view(np.float16).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    with pytest.raises(ValueError, match="whole blocks"):
        rows_to_float(np.zeros((2, 6), np.uint8), "f32")
