"""Session files that cannot be misread: checksums, the model's identity, the cache's geometry
and types, the format version; refusals leave the context exactly as it was; saving is atomic.
And in-memory states (save_state / load_state), which llama-cpp-python's caches keep."""
import zipfile

import numpy as np
import pytest

import entrokv_edge as ek
from entrokv_edge.runtime import session
from helpers import logits

SETTINGS = dict(budget=64, page_size=8, window=16, verbose=False, seed=0, n_threads=2, n_threads_batch=2)


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


@pytest.fixture
def saved(synth_models, tmp_path):
    """A compacted conversation saved to a file, and a second context in the middle of its own."""
    a = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=256, **SETTINGS)
    a.eval(prompt(600, 1))
    path = tmp_path / "chat.entrokv"
    a.save_session(path, extra={"messages": ["hi"]})
    b = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=256, **SETTINGS)
    b.eval(prompt(300, 2))
    return a, b, path


def unchanged(llm, before_logits, before_tp, n):
    """The context is as it was: same logical length, true positions and next-token logits."""
    assert llm.n_tokens == n
    assert np.array_equal(ek.true_positions(llm), before_tp)
    assert np.array_equal(logits(llm), before_logits)


def refused(llm, path, match):
    lg, tp, n = logits(llm), ek.true_positions(llm), llm.n_tokens
    with pytest.raises(ek.SessionError, match=match):
        llm.load_session(path)
    unchanged(llm, lg, tp, n)
    llm.eval([7])                          # and it goes on working
    assert llm.n_tokens == n + 1


def test_a_saved_session_loads_with_its_extra_and_logits(saved):
    a, b, path = saved
    assert b.load_session(path) == {"messages": ["hi"]}
    assert b.n_tokens == 600 and np.array_equal(logits(a), logits(b))
    assert np.array_equal(ek.true_positions(a), ek.true_positions(b))


@pytest.mark.parametrize("seed", range(4))
def test_flipped_bytes_in_the_state_are_refused_and_leave_the_context_as_it_was(saved, seed, tmp_path):
    """The reported case: 64 random bytes flipped inside the llama_state array."""
    a, b, path = saved
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    st = arrays["llama_state"]
    idx = np.random.default_rng(seed).choice(st.size, 64, replace=False)
    st[idx] ^= 0xFF
    bad = tmp_path / f"flipped{seed}.entrokv"
    with open(bad, "wb") as f:
        np.savez(f, **arrays)
    refused(b, bad, "checksum of 'llama_state' does not match")


def test_a_changed_header_or_missing_array_is_refused(saved, tmp_path):
    a, b, path = saved
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    meta = arrays["meta"].copy()
    meta[meta.size // 2] ^= 1
    (tmp_path / "h.entrokv").write_bytes(b"")
    with open(tmp_path / "h.entrokv", "wb") as f:
        np.savez(f, **{**arrays, "meta": meta})
    refused(b, tmp_path / "h.entrokv", "header|damaged")
    with open(tmp_path / "m.entrokv", "wb") as f:
        np.savez(f, **{k: v for k, v in arrays.items() if k != "true_pos"})
    refused(b, tmp_path / "m.entrokv", "'true_pos' is missing")


@pytest.mark.parametrize("keep", [0, 100, 0.5, 0.99])
def test_truncated_files_are_refused(saved, tmp_path, keep):
    a, b, path = saved
    data = path.read_bytes()
    cut = tmp_path / "cut.entrokv"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    refused(b, cut, "not an EntroKV Edge session|damaged")


def test_a_session_of_another_model_cache_size_or_type_is_refused(saved, synth_models, tmp_path):
    a, b, path = saved
    other = ek.EntroKVLlama(str(synth_models["llama-r2"]), n_ctx=256, **SETTINGS)
    other.eval(prompt(100, 3))
    refused(other, path, "another model")
    bigger = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=512, **SETTINGS)
    bigger.eval(prompt(100, 3))
    refused(bigger, path, "256-cell cache, this one has 512")
    f32 = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=256, type_k=0, type_v=0, **SETTINGS)
    f32.eval(prompt(100, 3))
    refused(f32, path, "another cache layout or type")


def test_an_older_format_is_refused_with_its_reason(saved, tmp_path):
    a, b, path = saved
    import json
    old = tmp_path / "v1.entrokv"
    meta = {"format": "entrokv-session-1", "config": {}, "n_compacted": 0, "kv_cells": 256, "n_tokens": 1}
    with open(old, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), llama_state=np.zeros(4, np.uint8))
    refused(b, old, "format 1")


def test_saving_is_atomic(saved, monkeypatch):
    """A save that fails half way (here: the archive writer raises) leaves the previous file whole
    and no temporary file behind."""
    a, b, path = saved
    before = path.read_bytes()
    real = np.savez

    def broken(f, **arrays):
        real(f, **{k: v for k, v in list(arrays.items())[:2]})
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError, match="disk full"):
        b.save_session(path)
    monkeypatch.setattr(np, "savez", real)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["chat.entrokv"]
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None


def test_in_memory_states_round_trip_and_refuse_another_context(synth_models):
    """save_state / load_state (what llama-cpp-python's caches keep between requests): the state
    holds only the last logits (not the n_batch x n_vocab score buffer), and restores a compacted
    conversation exactly; a state of another cache size is refused before anything changes."""
    a = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=256, **SETTINGS)
    a.eval(prompt(500, 5))
    st = a.save_state()
    assert isinstance(st, ek.EntroKVState) and st.scores.shape[0] == 0 and st.logits.shape == (a.n_vocab(),)
    assert st.nbytes < 2 * len(st.llama_state) + 4 * a.n_vocab() + 1_000_000
    ref = [int(np.argmax(logits(a)))]
    for _ in range(40):
        a.eval(ref[-1:])
        ref.append(int(np.argmax(logits(a))))
    a.load_state(st)
    got = [int(np.argmax(logits(a)))]
    for _ in range(40):
        a.eval(got[-1:])
        got.append(int(np.argmax(logits(a))))
    assert got == ref
    c = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=512, **SETTINGS)
    c.eval(prompt(50, 6))
    lg = logits(c)
    with pytest.raises(ek.SessionError, match="256-cell cache"):
        c.load_state(st)
    assert c.n_tokens == 50 and np.array_equal(logits(c), lg)
    with pytest.raises(ek.SessionError, match="not an EntroKVLlama state"):
        c.load_state(ek.llama_cpp.LlamaState(np.zeros(1, np.intc), np.zeros((1, 1), np.single), 1, b"", 0, 0))


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_a_well_formed_file_whose_state_llama_cpp_refuses_leaves_the_context_as_it_was(saved, tmp_path, cut):
    """Checksums right, identity right, but llama.cpp's own reader refuses the blob (cut short):
    the context is put back from the backup taken before the load."""
    a, b, path = saved
    st = session.read(path)
    st.llama_state = st.llama_state[: int(len(st.llama_state) * cut)]
    bad = tmp_path / "resigned.entrokv"
    session.write(bad, st)
    refused(b, bad, "refused")


def test_a_zip_flag_flipped_in_the_central_directory_is_refused(saved, tmp_path):
    """One bit of the archive's central directory (a member's 'encrypted' flag) made zipfile raise
    RuntimeError, which escaped as such; every damage now reads as SessionError."""
    a, b, path = saved
    data = bytearray(path.read_bytes())
    at = data.index(b"PK\x01\x02")          # the first central directory entry; its flags at +8
    data[at + 8] ^= 0x01
    bad = tmp_path / "flag.entrokv"
    bad.write_bytes(bytes(data))
    refused(b, bad, "damaged one .RuntimeError")


@pytest.mark.parametrize("change", ["fewer tokens", "more tokens", "token outside the vocabulary",
                                    "window scores of another shape", "NaN window score"])
def test_a_re_signed_state_that_does_not_fit_is_refused(saved, tmp_path, change):
    """Checksums right, identity right, content that cannot belong to the cache: a token count that
    is not the cache's (it loaded, then every position was off), a token id outside the vocabulary
    (llama.cpp aborts on it later), window scores an eviction cannot use (it raised at the next one)."""
    a, b, path = saved
    st = session.read(path)
    ws = st.window_scores
    if change == "fewer tokens":
        st.n_tokens -= 5
        st.input_ids = st.input_ids[:-5]
    elif change == "more tokens":
        st.n_tokens += 2
        st.input_ids = np.concatenate([st.input_ids, np.array([5, 6], np.int32)])
    elif change == "token outside the vocabulary":
        st.input_ids = st.input_ids.copy()
        st.input_ids[3] = 10**6
    elif change == "window scores of another shape":
        ws.scores = ws.scores[:, :-1]
    else:
        ws.scores = ws.scores.copy()
        ws.scores[0, 0, 0] = np.nan
    bad = tmp_path / "resigned.entrokv"
    session.write(bad, st)
    refused(b, bad, "cannot load this state")
