"""The question after the eviction: question-agnostic scores for entrokv-edge, against
head-independent eviction, on the fidelity judge's prompts (issue 7's open cells).

    python benchmarks/research/agnostic.py [--quick] [--models ...] [--out benchmarks/research/results/agnostic.json]

With the question after the eviction (the fidelity judge's "after" placement: a document
cached, evicted, then asked about) nothing in the cache tells the selection what will be
asked. Each source below scores the keys of the same prefill; entrokv-edge's selection
(its defaults, the draft off where the source brings its own queries) then evicts to 20%,
and the full cache's greedy answer is teacher-forced as in benchmarks/fidelity.py
(KL(full || evicted), mean over the answer):

  window   the prefix's last ``window`` tokens (entrokv-edge without its draft)
  edge     entrokv-edge with its defaults (the window, and a draft that continues the document)
  chunks   every prefill ubatch's tail of ``window`` queries (the issue's "several observation
           windows"): per key, the mean over the tails that saw it
  recon    context reconstruction (after KVzip, Kim et al. 2025): "Repeat the previous text
           exactly." and the whole document again, evaluated after the prompt in chunks of
           (nearly) equal size, at most 128 tokens, each its own observed ubatch (its last w
           queries, w the smallest chunk's size); per key, the mean over the chunks of their
           queries' attention; then the repeat is removed
  probe    a generic question in the model's chat form ("Summarize the text above.") evaluated
           after the prompt and observed, a 24-token greedy draft of its answer (drafted
           share and length as entrokv-edge's lookahead), then removed
  mix      chunks, recon and probe together: the mean of the three, each head's scores
           normalized to sum 1 first (the sources see different queries)
two bounds, from what does not exist yet when the eviction runs (report.AGNOSTIC_BOUNDS: never
a policy, they say where the gap lies):
  question the real question (the prompt's suffix in chat form) evaluated after the document,
           all its tokens one observed window, then removed: scores a store of the evicted
           pages could at best recall by once the question arrives
  answer   the question and the full cache's greedy answer (the reference the KL follows),
           teacher-forced as one observed window, then removed: the attention the answer pays,
           an upper bound for any scores this selection could be given
and head-independent eviction (each head's own top 20%, the union kept: 1.7-2x the tokens).
Prints per model each source's mean KL, kept tokens and paired wins-losses (with a two-sided
sign test) against head-independent eviction and against entrokv-edge's defaults, and writes
the rows (with the run's provenance) for benchmarks/report.py (REPORT.md section 4).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))      # the benchmarks' shared modules

import entrokv_edge as ek  # noqa: E402
from entrokv_edge.bindings.observe import Observation, WindowScores  # noqa: E402
from entrokv_edge.runtime.drafts import lookahead_scores, restore_tail  # noqa: E402
from llama_cpp import llama_cpp as C  # noqa: E402

import _harness as H  # noqa: E402
import fidelity as F  # noqa: E402
from report import _pairs, sign_test  # noqa: E402

SOURCES = ("window", "edge", "chunks", "recon", "probe", "mix", "question", "answer", "head-independent")
REPEAT = "\n\nRepeat the previous text exactly.\n\n"
PROBE = "Summarize the text above."
RECON_CHUNK = 128
FULL = dict(length=2048, n_qa=6, n_code=6, tokens=64)
QUICK = dict(length=1024, n_qa=1, n_code=0, tokens=8)
BUDGET = 0.2


def prefill_tails(llm, p: H.Prompt, window: int) -> tuple[H.Snapshot, np.ndarray]:
    """H.prefill's 'after' snapshot of ``p`` (its prefix, the last ``window`` tokens observed),
    and the chunk-tail scores [L, H, n]: every prefill ubatch's last ``window`` queries
    observed, per key the mean over the tails that saw it."""
    n = len(p.prefix)
    acc = np.zeros(0)
    seen = np.zeros(n)

    def add(v: WindowScores) -> None:
        nonlocal acc
        m = min(v.pos_last + 1, n)
        if acc.size == 0:
            acc = np.zeros((*v.scores.shape[:2], n))
        acc[:, :, :m] += v.scores[:, :, :m]
        seen[:m] += 1

    C.llama_memory_clear(llm._ctx.memory, True)
    llm.reset()
    with Observation(llm, window, handler=add) as obs:
        for i in range(0, n - window, llm.n_batch):
            llm.eval(p.prefix[i: min(i + llm.n_batch, n - window)])
        llm.eval(p.prefix[-window:])
    return H.snapshot(llm, obs.last), acc / np.maximum(seen, 1)


def recon_scores(llm, snap: H.Snapshot, doc: list[int]) -> np.ndarray:
    """[L, H, n]: the reconstruction's attention on the prompt's keys (see the module doc);
    the cache is as before when it returns."""
    n = snap.n_tokens
    last = H.logits(llm)
    acc, cnt = None, 0

    def add(v: WindowScores) -> None:
        nonlocal acc, cnt
        x = np.asarray(v.scores[:, :, :n], dtype=np.float64)
        acc = x.copy() if acc is None else acc + x
        cnt += 1

    if not doc:
        raise ValueError("nothing to reconstruct: the document is empty")
    cuts = np.linspace(0, len(doc), -(-len(doc) // RECON_CHUNK) + 1).round().astype(int)
    chunks = [doc[a:b] for a, b in zip(cuts[:-1], cuts[1:])]       # the whole document, chunks of equal size
    try:
        llm.eval(H.text_tokens(llm, REPEAT))
        with Observation(llm, min(map(len, chunks)), handler=add, keep_last=False):
            for c in chunks:
                llm.eval(c)
    finally:
        restore_tail(llm, n, last)
    return acc / cnt


def probe_scores(llm, snap: H.Snapshot, k: int, share: float) -> np.ndarray:
    """[L, H, n]: a generic question's and its drafted answer's attention on the prompt's keys;
    the cache is as before when it returns."""
    n = snap.n_tokens
    last = H.logits(llm)
    _, tail = H.chat_parts(llm, PROBE)
    try:
        with Observation(llm, len(tail)) as obs:
            llm.eval(tail)
        s = lookahead_scores(llm, obs.last, k, llm.eval, share=share)
    finally:
        restore_tail(llm, n, last)
    return np.asarray(s.scores[:, :, :n], dtype=np.float64)


def _unit(x: np.ndarray) -> np.ndarray:
    t = x.sum(axis=-1, keepdims=True)
    return x / np.where(t > 0, t, 1.0)


def _as_scores(snap: H.Snapshot, x: np.ndarray) -> WindowScores:
    s = snap.scores
    return WindowScores(x, s.true_pos, s.layer_ids, s.window, s.n_tokens, s.pos_last)


def run(models, length, n_qa, n_code, tokens, log=print) -> list[dict]:
    rows = []
    for model in models:
        llm = H.load(model, 2 * length + tokens + 512)      # room for the reconstruction
        stop = H.stop_tokens(llm)
        window = ek.EvictionConfig().window
        for p in F.qa_prompts(llm, n_qa, length) + F.code_prompts(llm, n_code, length):
            snap, tails = prefill_tails(llm, p, window)
            head, _ = H.chat_parts(llm, p.meta["question"])

            def first():
                llm.eval(p.suffix)
                return H.logits(llm)
            H.restore(llm, snap)
            rf = first()
            ref = H.greedy(llm, rf, tokens, stop) or [int(np.argmax(rf))]
            H.restore(llm, snap)
            full_lp = F._follow(llm, first(), ref)
            H.restore(llm, snap)
            recon = recon_scores(llm, snap, p.prefix[len(head):])
            edge = ek.EvictionConfig(budget=BUDGET)
            probe = probe_scores(llm, snap, edge.lookahead, edge.lookahead_share)
            mix = (_unit(tails) + _unit(recon) + _unit(probe)) / 3
            question = H.seen_scores(llm, snap, p.suffix)
            answer = H.seen_scores(llm, snap, p.suffix + ref)
            own = ek.EvictionConfig(budget=BUDGET, lookahead=0)
            cases = {"window": (own, None), "edge": (edge, None), "chunks": (own, tails), "recon": (own, recon),
                     "probe": (own, probe), "mix": (own, mix), "question": (own, question), "answer": (own, answer),
                     "head-independent": (ek.EvictionConfig(budget=BUDGET, policy="head-independent"), None)}
            for src, (cfg, x) in cases.items():
                m = H.evict_from(llm, snap, cfg, scores=None if x is None else _as_scores(snap, x))
                lp = F._follow(llm, first(), ref)
                kl = float(np.mean(F._kl(full_lp, lp)))
                rows.append({"model": model, "kind": p.meta["kind"], "source": p.meta["source"], "scores": src,
                             "kl_mean": kl, "kept_tokens": int(m["kept_tokens"]), "prompt_tokens": len(p.prefix),
                             "tokens": len(ref)})
            log(f"agnostic {model} {p.meta['kind']} {p.meta['source']}: done")
        llm.close()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (model, scores): mean KL, kept tokens, paired wins-losses against head-independent
    eviction and against entrokv-edge's defaults (on the same prompts: model, kind, source)."""
    out = []
    for model in sorted({r["model"] for r in rows}):
        mr = [r for r in rows if r["model"] == model]
        for src in SOURCES:
            mine = [r for r in mr if r["scores"] == src]
            if not mine:
                continue
            s = {"model": model, "scores": src, "prompts": len(mine),
                 "kl_mean": float(np.mean([r["kl_mean"] for r in mine])),
                 "kept_tokens": float(np.mean([r["kept_tokens"] for r in mine]))}
            pairs = _pairs(mr, ("kind", "source"), "kl_mean", lambda a, c: (a < c) - (a > c), src,
                           ("head-independent", "edge"), field="scores")
            for ref, (w, lo, _) in pairs.items():
                s[f"vs_{ref}"] = {"wins": w, "losses": lo, "p": sign_test(w, lo)}
            out.append(s)
    return out


def main(argv=None) -> int:
    import evidence
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=evidence.MODELS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "agnostic.json"))
    args = ap.parse_args(argv)
    g = QUICK if args.quick else FULL
    commit, t0 = evidence.commit_id(), time.perf_counter()
    rows = run(args.models, g["length"], g["n_qa"], g["n_code"], g["tokens"])
    summ = summary(rows)
    settings = {**g, "budget": BUDGET, "probe": PROBE, "repeat": REPEAT, "recon_chunk": RECON_CHUNK,
                "edge_defaults": ek.controller.config.EDGE_DEFAULTS, "threads": H.threads()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": evidence.meta("quick" if args.quick else "full", settings,
                                                     time.perf_counter() - t0, commit),
                               "data": {"rows": rows, "summary": summ}}, indent=1))
    print("| model | scores | mean KL | kept tokens | vs head-independent | vs entrokv-edge |")
    print("|---|---|---|---|---|---|")
    for s in summ:
        hi, ed = s["vs_head-independent"], s["vs_edge"]
        print(f"| {s['model']} | {s['scores']} | {s['kl_mean']:.3f} | {s['kept_tokens']:.0f} | "
              f"{hi['wins']}-{hi['losses']} (p {hi['p']:.3f}) | {ed['wins']}-{ed['losses']} (p {ed['p']:.3f}) |")
    print(f"{len(rows)} rows -> {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
