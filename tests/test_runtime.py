"""EntroKVLlama: long prompts through a small cache, generation that never runs out of
cache, chats that append, edited histories, saved sessions and the memory report."""
import numpy as np
import pytest

import entrokv_edge as ek
from helpers import logits

SETTINGS = dict(budget=64, page_size=8, window=16, verbose=False, seed=0, n_threads=2, n_threads_batch=2)


@pytest.fixture
def model(synth_models):
    return str(synth_models["llama-r3"])


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def test_a_prompt_four_times_the_cache_runs_and_generation_never_overflows(model):
    llm = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    assert llm.kv_report()["evictions"] == 0 and llm.kv_report()["eviction_s"] == 0.0
    toks = prompt(1000)
    llm.eval(toks)
    rep = llm.kv_report()
    assert llm.n_tokens == 1000 and rep["logical_tokens"] == 1000 and llm.stats.evictions >= 4
    assert rep["evictions"] == llm.stats.evictions and rep["eviction_s"] > 0
    assert rep["kept_tokens"] == 64 == ek.geometry(llm).n_used                 # the budget, exactly
    assert rep["kv_bytes_kept"] * 1000 == rep["kv_bytes_full"] * 64
    tp = ek.true_positions(llm)[:, :64]
    assert (tp[:, :4] == np.arange(4)).all() and (tp[:, -8:] == np.arange(992, 1000)).all()   # sinks, recent
    for _ in range(400):                                                        # far past the cache size
        llm.eval([int(np.argmax(logits(llm)))])
    assert llm.n_tokens == 1400 and ek.geometry(llm).n_used <= 256
    assert ek.geometry(llm).pos_max == 1399


def test_streaming_equals_non_streaming_with_greedy_sampling(smollm2):
    # a real tokenizer: random byte tokens of the synthetic vocabulary decode differently in
    # pieces (partial UTF-8), which says nothing about the cache
    a = ek.EntroKVLlama(str(smollm2), n_ctx=256, **SETTINGS)
    b = ek.EntroKVLlama(str(smollm2), n_ctx=256, **SETTINGS)
    text = " ".join(f"Item {i} of the inventory is a {w}." for i, w in enumerate(["lamp", "rope", "map"] * 40))
    toks = a.tokenize(text.encode())
    full = a.create_completion(toks, max_tokens=150, temperature=0.0)["choices"][0]["text"]
    streamed = "".join(c["choices"][0]["text"] for c in b.create_completion(toks, max_tokens=150, temperature=0.0,
                                                                              stream=True))
    assert full == streamed and len(full) > 0
    assert a.stats.evictions == b.stats.evictions >= 2


def test_chat_turns_append_and_an_edited_history_is_re_evaluated(model):
    llm = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    seen = []
    llm.events.listen("eval", lambda rt, tokens: seen.append(len(tokens)))      # every call of eval, generate's too
    turn1 = prompt(400, 2)
    gen = llm.generate(turn1, top_k=1, temp=0.0)
    reply = [next(gen) for _ in range(10)]
    gen.close()
    n_after_turn1 = llm.n_tokens
    seen.clear()
    turn2 = turn1 + reply[:-1] + prompt(30, 3)      # the history as evaluated, then a new message
    gen = llm.generate(turn2, top_k=1, temp=0.0)
    next(gen)
    gen.close()
    assert seen[0] == len(turn2) - n_after_turn1      # only the new tokens: no re-prefill
    assert llm.n_tokens == len(turn2)
    seen.clear()
    edited = [5] + turn2[1:]                          # the user changed the first message
    gen = llm.generate(edited, top_k=1, temp=0.0)
    next(gen)
    gen.close()
    assert seen[0] == len(edited)                     # re-evaluated from scratch
    fresh = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    fresh.eval(edited)
    assert np.array_equal(logits(fresh), logits(llm))  # the same as a fresh context on the edited prompt


def test_saved_sessions_restore_the_same_logits_and_tables(model, tmp_path):
    a = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    a.eval(prompt(700, 4))
    for _ in range(5):
        a.eval([int(np.argmax(logits(a)))])
    path = tmp_path / "chat.entrokv"
    a.save_session(path)
    b = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    b.load_session(path)
    assert b.n_tokens == a.n_tokens and np.array_equal(logits(a), logits(b))
    assert np.array_equal(ek.true_positions(a), ek.true_positions(b))
    for _ in range(150):                               # both go on identically, evicting on the way
        ta, tb = int(np.argmax(logits(a))), int(np.argmax(logits(b)))
        assert ta == tb
        a.eval([ta]), b.eval([tb])
    assert np.array_equal(logits(a), logits(b)) and a.stats.evictions > 0
    with pytest.raises(ValueError, match="not an EntroKV Edge session"):
        (tmp_path / "junk").write_bytes(b"hello")
        b.load_session(tmp_path / "junk")
    c = ek.EntroKVLlama(model, n_ctx=512, **SETTINGS)
    with pytest.raises(ValueError, match="256-cell cache"):
        c.load_session(path)


def test_a_session_saved_before_an_option_existed_loads_with_it_off(model, tmp_path):
    """A session from before ``decay``, ``value_power``, ``lookahead`` and ``lookahead_share`` existed (its settings lack the keys)
    had neither: loading it must not switch on today's defaults (decay 0.85 under its spread)."""
    from entrokv_edge.runtime import session
    a = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS, spread=4, decay=0.5)
    a.eval(prompt(300, 2))
    path = tmp_path / "old.entrokv"
    a.save_session(path)
    state = session.read(path)            # the same file as an older version would have written it
    for k in ("decay", "value_power", "lookahead", "lookahead_share"):
        del state.settings[k]
    session.write(path, state)
    b = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    b.load_session(path)
    assert b.config.decay == 1.0 and b.config.spread == 4 and b.config.policy == "entrokv-edge"
    assert b.config.value_power == 0.0 and b.config.lookahead == 0 and b.config.lookahead_share == 0.0
    assert np.array_equal(logits(a), logits(b))


def test_settings_are_checked(model):
    with pytest.raises(ValueError, match="too small"):
        ek.EntroKVLlama(model, n_ctx=256, **{**SETTINGS, "budget": 192, "page_size": 64, "window": 64})
    with pytest.raises(ValueError, match="logits_all"):
        ek.EntroKVLlama(model, n_ctx=256, logits_all=True, **SETTINGS)
    with pytest.raises(TypeError):
        ek.EntroKVLlama(model, n_ctx=256, eviction=ek.EvictionConfig(), **SETTINGS)
    # what llama.cpp cannot take: more threads than ggml's maximum crashed inside ggml; a cache size
    # beyond uint32 was truncated (2**32 + 256 cells became 256)
    with pytest.raises(ValueError, match="at most 512"):
        ek.EntroKVLlama(model, n_ctx=256, **{**SETTINGS, "n_threads": 100_000})
    with pytest.raises(ValueError, match="n_ctx must be in"):
        ek.EntroKVLlama(model, n_ctx=2**32 + 256, **SETTINGS)


def test_a_6k_token_prompt_through_a_1024_cell_cache_keeps_a_fact_from_its_start(smollm2):
    # the full-cache model answers this (BLUEBIRD) at 6.3k tokens; the question is asked in
    # completion form, which SmolLM2-135M answers reliably at this length
    animals = ["fox", "heron", "goat", "otter", "crow", "badger", "mule"]
    places = ["mill", "harbor", "orchard", "bridge", "market", "chapel", "quarry"]
    things = ["lantern", "basket", "rope", "coin", "kettle", "ladder", "map"]
    filler = "\n".join(f"On day {i}, the {animals[i % 7]} walked to the {places[(i * 3) % 7]} and found a "
                       f"{things[(i * 5) % 7]}." for i in range(330))
    text = ("Important: the password for the meeting is BLUEBIRD.\n" + filler +
            "\nQuestion: What is the password for the meeting?\nAnswer: The password for the meeting is")
    llm = ek.EntroKVLlama(str(smollm2), n_ctx=1024, budget=512, page_size=16, window=32, verbose=False,
                          seed=0, n_threads=2, n_threads_batch=2)
    out = llm.create_completion(text, max_tokens=6, temperature=0.0)
    assert out["usage"]["prompt_tokens"] > 6000
    assert "BLUEBIRD" in out["choices"][0]["text"]
    assert ek.geometry(llm).n_used <= 1024 and llm.stats.evictions >= 8


def test_call_stop_sequences_and_sampling_work_as_in_llama_cpp(smollm2):
    llm = ek.EntroKVLlama(str(smollm2), n_ctx=256, budget=64, page_size=8, window=16, verbose=False, seed=1)
    out = llm("Count with me: one, two, three, four,", max_tokens=20, stop=[","], temperature=0.0)
    text = out["choices"][0]["text"]
    assert "," not in text and out["choices"][0]["finish_reason"] == "stop"
    sampled = llm("The weather today is", max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=3)
    again = llm("The weather today is", max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=3)
    assert sampled["choices"][0]["text"] == again["choices"][0]["text"]   # seeded sampling is reproducible


@pytest.mark.parametrize("guide_draft", [0, 4])
def test_a_long_prompt_leaves_room_for_the_drafts_its_evictions_are_scored_with(model, guide_draft):
    """A prompt read in pieces: every guided eviction drafts after the guide with room for guide_draft tokens,
    and the eviction after the prompt with room for its whole lookahead draft (the pieces leave them the cells;
    a draft may still stop early at an end-of-generation token); the drafts leave nothing behind, and the
    budget holds."""
    drafts = []
    cfg = dict(SETTINGS, lookahead=8, guide=16, guide_draft=guide_draft)
    llm = ek.EntroKVLlama(model, n_ctx=256, **cfg)
    llm.events.listen("drafted", lambda rt, kind, k, room, drafted: drafts.append((k, room, drafted)))
    toks = prompt(1000, seed=3)
    llm.eval(toks)
    rep = llm.kv_report()
    assert rep["evictions"] >= 4 and rep["guided_evictions"] == rep["evictions"] - 1
    ks = [k for k, _, _ in drafts]
    assert ks == [guide_draft] * rep["guided_evictions"] * bool(guide_draft) + [8]
    assert all(room >= k for k, room, _ in drafts) and rep["drafted_tokens"] == sum(d for _, _, d in drafts)
    assert sum(d for _, _, d in drafts) >= sum(ks) // 2         # (drafts that stop at once would test nothing)
    assert llm.n_tokens == 1000 and ek.geometry(llm).pos_max == 999 and rep["kept_tokens"] == 64
    for n in range(900, 1000, 7):                         # wherever the last pieces fall, every eviction between
        llm.reset()                                       # pieces is guided and drafts (none runs on stale scores)
        drafts.clear()
        before = llm.kv_report()
        llm.eval(toks[:n])
        rep = llm.kv_report()
        ev, guided = (rep[k] - before[k] for k in ("evictions", "guided_evictions"))
        assert guided == ev - 1 and [k for k, _, _ in drafts] == [guide_draft] * guided * bool(guide_draft) + [8], n
        assert all(room >= k for k, room, _ in drafts), n
        assert rep["drafted_tokens"] - before["drafted_tokens"] == sum(d for _, _, d in drafts), n
    fits = ek.EntroKVLlama(model, n_ctx=256, **cfg)       # a prompt the cache holds: read in one piece, as before
    fits.eval(toks[:180])
    assert fits.kv_report()["evictions"] == 1 and fits.kv_report()["guided_evictions"] == 0


def test_guided_evictions_keep_pages_common_to_every_buffer_and_the_last_eviction_its_own_consensus(model):
    """guide_consensus: each guided eviction between pieces gives that share of every (layer, group) buffer's free
    pages to pages all buffers keep (the consensus); the eviction after the prompt keeps ``consensus``. Without
    it the buffers share fewer pages than that."""
    seen = []

    def shared_pages(guide_consensus):
        """Per guided eviction: (unprotected pages every buffer keeps, free pages per buffer: budget minus protected)."""
        seen.clear()
        llm = ek.EntroKVLlama(model, n_ctx=256, **dict(SETTINGS, guide=16, guide_consensus=guide_consensus))
        llm.events.listen("evicted", lambda rt, controller, result: seen.append((controller.config.consensus,
                                                                                 result.selection)))
        llm.eval(prompt(1000, seed=5))
        rep = llm.kv_report()
        assert rep["guided_evictions"] == rep["evictions"] - 1 >= 4 and len(seen) == rep["evictions"]
        assert [c for c, _ in seen] == [guide_consensus] * (len(seen) - 1) + [llm.config.consensus]
        out = []
        for _, sel in seen[:-1]:
            pages = sel.pages.reshape(-1, sel.pages.shape[-1])
            prot = set(llm.config.protected((int(pages.max()) + 1) * llm.config.page_size))
            shared = set(pages[0].tolist()).intersection(*(set(p.tolist()) for p in pages[1:])) - prot
            out.append((len(shared), sel.n_budget - len(prot)))
        return out

    with_share = shared_pages(0.5)
    assert all(shared >= int(0.5 * free) for shared, free in with_share)
    without = shared_pages(0.0)
    assert sum(shared < int(0.5 * free) for shared, free in without) >= len(without) // 2


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


@pytest.mark.skipif(ek.runtime.host._malloc_trim is None, reason="no malloc_trim in this C library (not glibc)")
def test_an_eviction_gives_the_heaps_free_pages_back_to_the_system(model):
    llm = ek.EntroKVLlama(model, n_ctx=256, **SETTINGS)
    try:
        llm.eval(prompt(200))
        # 64 MiB in 64 KiB blocks (on the heap: below glibc's mmap threshold), written to; every other one freed:
        # 32 MiB of holes between live blocks, which glibc keeps resident for reuse
        blocks = [bytearray(b"\x01") * (64 << 10) for _ in range(1024)]
        del blocks[::2]
        before = _rss_kib()
        llm.evict()
        freed = before - _rss_kib()
        assert freed > 16 << 10, f"{freed} KiB given back"
        del blocks
    finally:
        llm.close()
