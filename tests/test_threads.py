"""Threads: two EntroKVLlama instances decoding at once in one process (observations and
per-context state never cross), and one instance used from two threads (its calls serialize on
one lock; while a generation is unfinished, a second one, or a cache call from another thread,
raises RuntimeError)."""
import threading

import numpy as np
import pytest

import entrokv_edge as ek
from helpers import logits

SETTINGS = dict(page_size=8, verbose=False, seed=0, n_threads=1, n_threads_batch=1)   # ggml's own threads: 1


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def conversation(llm, toks, n_new: int) -> dict:
    """A prompt longer than the cache, then greedy decoding one token at a time: the tokens, their
    logits, every eviction's kept positions, the freshest window scores and the true positions."""
    kept = []
    llm.events.listen("evicted", lambda rt, controller, result: kept.append((rt.n_tokens, result.positions.copy())))
    llm.eval(toks)
    out, lgs = [], []
    for _ in range(n_new):
        lg = logits(llm)
        lgs.append(lg)
        out.append(int(np.argmax(lg)))
        llm.eval(out[-1:])
    return {"tokens": out, "logits": np.stack(lgs), "kept": kept, "scores": llm._window_scores.scores.copy(),
            "tp": ek.true_positions(llm)}


def same(x: dict, y: dict) -> bool:
    return (x["tokens"] == y["tokens"] and np.array_equal(x["logits"], y["logits"])
            and len(x["kept"]) == len(y["kept"]) and all(a[0] == b[0] and np.array_equal(a[1], b[1])
                                                         for a, b in zip(x["kept"], y["kept"]))
            and np.array_equal(x["scores"], y["scores"]) and np.array_equal(x["tp"], y["tp"]))


def run_together(jobs):
    """Run each job in its own thread, started at once; re-raise the first exception."""
    results, errors = [None] * len(jobs), []
    barrier = threading.Barrier(len(jobs))

    def work(i, job):
        try:
            barrier.wait()
            results[i] = job()
        except BaseException as e:   # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("models", [("llama-r3", "llama-r3"), ("llama-r3", "qwen2-r2")], ids=["same", "different"])
def test_two_instances_decoding_at_once_equal_each_alone(synth_models, models):
    """Each instance observes (its own window), evicts (during the prompt and while decoding) and
    decodes in its own thread, both at once: every token, logit, kept position and window score
    equals the same instance's run alone."""
    specs = [(synth_models[models[0]], dict(budget=64, window=16), prompt(700, 1)),
             (synth_models[models[1]], dict(budget=48, window=8), prompt(650, 2))]

    def make(i):
        path, cfg, _ = specs[i]
        return ek.EntroKVLlama(str(path), n_ctx=256, **cfg, **SETTINGS)
    alone = [conversation(make(i), specs[i][2], 240) for i in range(2)]
    for _ in range(2):
        pair = [make(0), make(1)]
        together = run_together([lambda i=i: conversation(pair[i], specs[i][2], 240) for i in range(2)])
        for (_, _, toks), a, t in zip(specs, alone, together):
            assert any(n > len(toks) for n, _ in t["kept"]), "evictions while decoding too"
            assert same(a, t)


def test_cache_calls_from_two_threads_serialize(synth_models):
    """Two threads evaluate a chunk each into one instance at once: the calls run one after the
    other, so the conversation equals one of the two orders, evaluated in one thread."""
    path = synth_models["llama-r3"]
    base, a, b = prompt(60, 3), prompt(40, 4), prompt(40, 5)

    def fresh():
        llm = ek.EntroKVLlama(str(path), n_ctx=256, budget=64, window=16, **SETTINGS)
        llm.eval(base)
        return llm
    refs = {}
    for order in ((a, b), (b, a)):
        r = fresh()
        for chunk in order:
            r.eval(chunk)
        refs[id(order[0])] = (list(r.input_ids[: r.n_tokens]), logits(r), ek.true_positions(r))
    for _ in range(3):
        llm = fresh()
        run_together([lambda: llm.eval(a), lambda: llm.eval(b)])
        ids = list(llm.input_ids[: llm.n_tokens])
        want = refs[id(a)] if ids[len(base): len(base) + len(a)] == a else refs[id(b)]
        assert ids == want[0] and llm.n_tokens == len(base) + len(a) + len(b)
        assert np.array_equal(logits(llm), want[1]) and np.array_equal(ek.true_positions(llm), want[2])


def test_an_unfinished_generation_refuses_other_threads_until_it_ends(synth_models):
    """While a stream is unfinished: a second generation (any thread) and cache calls from another
    thread raise RuntimeError and change nothing; the thread that resumes the stream may go on
    (and becomes its owner); once the stream is closed, the other thread's calls work."""
    llm = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=256, budget=64, window=16, **SETTINGS)
    toks = prompt(40, 6)
    stream = llm.generate(toks, top_k=1, temp=0.0)
    first = next(stream)
    n, lg = llm.n_tokens, logits(llm)

    def elsewhere():
        out = {}
        for name, call in (("generate", lambda: next(llm.generate(toks, top_k=1, temp=0.0))),
                           ("completion", lambda: llm.create_completion(toks, max_tokens=2)),
                           ("eval", lambda: llm.eval([5])), ("reset", llm.reset), ("evict", llm.evict),
                           ("save_state", llm.save_state), ("load_state", lambda: llm.load_state(llm_state)),
                           ("close", llm.close)):
            try:
                call()
                out[name] = "ran"
            except RuntimeError as e:
                out[name] = str(e)
        return out
    llm_state = None
    with pytest.raises(RuntimeError, match="already generating"):
        next(llm.generate(toks, top_k=1, temp=0.0))          # a second generation in the same thread
    llm_state = llm.save_state()                             # the generating thread itself may
    got = run_together([elsewhere])[0]
    assert all("generat" in v and "finish or close" in v for v in got.values()), got
    assert llm.n_tokens == n and np.array_equal(logits(llm), lg)

    second = run_together([lambda: next(stream)])[0]         # resumed in another thread: it goes on there
    assert llm.n_tokens == n + 1
    with pytest.raises(RuntimeError, match="generating in another thread"):
        llm.eval([5])                                        # this thread is now the other one
    stream.close()
    done = run_together([lambda: llm.eval([first, second])])
    assert done == [None] and llm.n_tokens == n + 3
    gen = llm.generate(toks, top_k=1, temp=0.0)                # and generating works again
    assert isinstance(next(gen), int)
    gen.close()
