"""Every refusal raises, names its reason, and leaves the cache exactly as it was;
after a compaction, operations that would corrupt it are refused or handled."""
import numpy as np
import pytest

import entrokv_edge as ek
from helpers import feed, make_llm, random_keep, state_blob
from llama_cpp import llama_cpp as C

N = 40


@pytest.fixture
def pair(synth_models):
    """A context with N tokens and a twin that never sees the failed calls."""
    a, b = make_llm(synth_models["llama-r3"], type_k="f32"), make_llm(synth_models["llama-r3"], type_k="f32")
    toks = np.random.default_rng(0).integers(3, 300, N)
    feed(a, toks), feed(b, toks)
    return a, b


def _good(g, K=10):
    return random_keep(np.random.default_rng(1), g.n_slots, N, K, protect=2)


def _lists_unequal(g):
    k = [list(r) for r in _good(g)]
    k[-1] = k[-1][:-1]
    return k


def _cases():
    return {
        "unequal lengths": (lambda g: _lists_unequal(g), "LIST_LENGTH"),
        "empty lists": (lambda g: np.zeros((g.n_slots, 0), np.int32), "LIST_LENGTH"),
        "more cells than the sequence has": (lambda g: np.tile(np.arange(N + 1), (g.n_slots, 1)), "LIST_LENGTH"),
        "cell beyond the cache": (lambda g: np.where(np.arange(10) == 9, g.kv_size, _good(g)), "CELL_RANGE"),
        "negative cell": (lambda g: np.where(np.arange(10) == 0, -1, _good(g)), "CELL_RANGE"),
        "unsorted": (lambda g: _good(g)[:, ::-1].copy(), "CELL_ORDER"),
        "duplicate": (lambda g: np.where(np.arange(10) == 1, _good(g)[:, :1], _good(g)), "CELL_ORDER"),
        "empty cell": (lambda g: np.tile(np.arange(N - 9, N + 1), (g.n_slots, 1)), "CELL_NOT_IN_SEQ"),
        "too few lists": (lambda g: _good(g)[:-1], "INVALID_ARG"),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_bad_keep_lists_are_refused_and_change_nothing(pair, case):
    a, b = pair
    g = ek.geometry(a)
    make, name = _cases()[case]
    before = state_blob(a)
    with pytest.raises(ek.EntroKVError) as e:
        ek.compact(a, make(g))
    assert e.value.name == f"LLAMA_ENTROKV_ERR_{name}" and e.value.message
    assert state_blob(a) == before and ek.geometry(a) == g
    assert np.array_equal(feed(a, [7]), feed(b, [7]))


def test_unordered_lists_still_refuse_duplicates(pair):
    a, _ = pair
    g = ek.geometry(a)
    k = np.tile(np.array([5, 3, 5, 9], dtype=np.int32), (g.n_slots, 1))
    before = state_blob(a)
    with pytest.raises(ek.EntroKVError, match="CELL_ORDER"):
        ek.compact(a, k, unordered=True)
    assert state_blob(a) == before


def test_second_sequence_is_refused(pair):
    a, _ = pair
    C.llama_memory_seq_cp(a._ctx.memory, 0, 1, -1, -1)
    before = state_blob(a)
    with pytest.raises(ek.EntroKVError, match="MULTI_SEQ"):
        ek.compact(a, _good(ek.geometry(a)))
    assert state_blob(a) == before


def test_pending_k_shift_is_refused(pair):
    a, _ = pair
    C.llama_memory_seq_add(a._ctx.memory, 0, 20, -1, 3)  # leaves a K-shift pending
    before = state_blob(a)
    with pytest.raises(ek.EntroKVError, match="PENDING_SHIFT"):
        ek.compact(a, _good(ek.geometry(a)))
    assert state_blob(a) == before


def test_unknown_flags_and_null_context_are_refused(pair):
    a, _ = pair
    from entrokv_edge.bindings.native import c_api, context_pointer
    ffi, lib = c_api()
    lens = np.full(ek.geometry(a).n_slots, 10, np.int32)
    cells = _good(ek.geometry(a)).ravel().astype(np.int32)
    rc = lib.llama_entrokv_compact(context_pointer(a), 0, len(lens), ffi.from_buffer("int32_t[]", lens),
                                   ffi.from_buffer("int32_t[]", cells), 1 << 7)
    assert rc == lib.LLAMA_ENTROKV_ERR_INVALID_ARG and b"flags" in ffi.string(lib.llama_entrokv_last_error())
    assert lib.llama_entrokv_compact(ffi.NULL, 0, 0, ffi.NULL, ffi.NULL, 0) == lib.LLAMA_ENTROKV_ERR_INVALID_ARG
    with pytest.raises(ValueError):
        ek.geometry(0)


def test_empty_sequence_is_refused(synth_models):
    a = make_llm(synth_models["llama-r2"])
    with pytest.raises(ek.EntroKVError, match="EMPTY_SEQ"):
        ek.compact(a, np.zeros((ek.geometry(a).n_slots, 1), np.int32))


def test_after_compaction_range_edits_are_refused_or_handled(pair):
    a, b = pair
    g = ek.geometry(a)
    keep = _good(g)
    ek.compact(a, keep)
    feed(a, [9, 10, 11])                     # positions N..N+2, after the compacted cells
    snap = state_blob(a)
    mem = a._ctx.memory
    assert not C.llama_memory_seq_rm(mem, 0, N - 5, -1)   # would cut into compacted cells
    assert not C.llama_memory_seq_rm(mem, -1, 3, N - 2)
    C.llama_memory_seq_add(mem, 0, 0, N - 3, 2)           # would shift compacted cells
    C.llama_memory_seq_div(mem, 0, 0, -1, 2)
    assert state_blob(a) == snap and ek.n_refused(a) == 4
    assert ek.geometry(a).n_compacted == 10

    assert C.llama_memory_seq_rm(mem, 0, N + 1, -1)        # only uncompacted tokens: allowed
    assert ek.geometry(a).n_used == 11
    assert (ek.true_positions(a)[:, :10] == keep).all()

    assert C.llama_memory_seq_rm(mem, 0, -1, -1)           # whole sequence: allowed, table reset
    g2 = ek.geometry(a)
    assert g2.n_used == 0 and g2.n_compacted == 0


def test_prefix_reuse_cannot_damage_a_compacted_cache(synth_models):
    path = synth_models["llama-r3"]
    a, fresh = make_llm(path, type_k="f32"), make_llm(path, type_k="f32")
    toks = [int(t) for t in np.random.default_rng(2).integers(3, 300, N)]
    feed(a, toks)
    ek.compact(a, _good(ek.geometry(a)))
    # a new prompt sharing the first 30 tokens: llama-cpp-python tries seq_rm(30, -1);
    # it must be refused and the prompt re-evaluated from scratch
    prompt2 = toks[:30] + [5, 6, 7, 8]
    gen_a = a.generate(prompt2, top_k=1, temp=0.0)
    gen_f = fresh.generate(prompt2, top_k=1, temp=0.0)
    out_a = [next(gen_a) for _ in range(5)]
    out_f = [next(gen_f) for _ in range(5)]
    assert out_a == out_f
    assert ek.geometry(a).n_compacted == 0 and ek.n_refused(a) >= 1


@pytest.mark.parametrize("arch,reason", [("qwen2vl", "M-RoPE"), ("mpt", "ALiBi"), ("mamba", "recurrent")])
def test_unsupported_models_are_refused(tmp_path, arch, reason):
    from synth import write_model
    llm = make_llm(write_model(tmp_path / f"{arch}.gguf", arch=arch, n_head=4, n_head_kv=2 if arch != "mpt" else 4))
    feed(llm, range(3, 23))
    before = state_blob(llm)
    for call in (lambda: ek.geometry(llm), lambda: ek.compact(llm, np.zeros((4, 5), np.int32))):
        with pytest.raises(ek.EntroKVError, match=reason) as e:
            call()
        assert e.value.name == "LLAMA_ENTROKV_ERR_UNSUPPORTED"
    assert state_blob(llm) == before
