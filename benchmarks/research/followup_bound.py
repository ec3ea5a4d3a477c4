"""The follow-up questions with the question known at the eviction: what the selection itself can answer at
20% resident, as a bound for the recall tier (issue 23's follow-up goal).

benchmarks/recall.py's follow-up part asks each question after the first turn's eviction; the recall has
to bring back what the question needs. Here every question is instead read together with everything
before it (the document, the first turn, the earlier questions and the answers the full cache gave them)
as one prompt, evicted once after it to 20% by EntroKVLlama's defaults without recall, so that the
eviction is scored by the question itself (its observed window and the lookahead draft); then answered
(greedy, as there). The same transcript on the full cache is the reference. A recall can at best make the
cache what a question-aware eviction of the same size would keep; where that eviction loses the answer,
no recall schedule is what is missing.

    python benchmarks/research/followup_bound.py [--models ...] [--split tune|heldout] [--docs N]

Rows (benchmarks/research/results/followup_bound.json, merged by model and split): configuration "full" and
"question-known", per document and fact, with the answer.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import _harness as H  # noqa: E402
import evidence  # noqa: E402
import recall as R  # noqa: E402


def rows_for(model: str, g: dict, split: str, commit: str, log=print) -> list[dict]:
    n_ctx = g["length"] + 512
    full = H.load(model, n_ctx)
    ev = R._runtime(model, n_ctx, False)
    rows = []
    try:
        for i in range(g["docs"]):
            text, facts = R.document(full, i, g["length"], split)
            R.ek.llama_cpp.llama_memory_clear(full._ctx.memory, True)
            full.reset()
            chat = R.Chat(full)
            chat.ask(f"{text}\n\n{R.FIRST_TURN}", g["first_tokens"])
            t0 = time.perf_counter()
            for j, f in enumerate(facts):
                before = (copy.deepcopy(chat.msgs), chat.text)       # the transcript up to this question
                ans = chat.ask(f["question"], g["answer_tokens"])
                ev.reset()
                n_ev = ev.kv_report()["evictions"]
                oracle = R.Chat(ev)
                oracle.msgs, oracle.text = before
                got = oracle.ask(f["question"], g["answer_tokens"])
                m = ev.last_eviction.metrics if ev.kv_report()["evictions"] > n_ev else {}
                base = {"model": model, "split": split, "doc": i, "fact": j, "depth": R.DEPTHS[j],
                        "number": f["number"], "commit": commit}
                rows.append({**base, "config": "full", "right": f["number"] in ans, "answer": ans.strip()})
                rows.append({**base, "config": "question-known", "right": f["number"] in got, "answer": got.strip(),
                             "kept_tokens": int(m.get("kept_tokens", 0)),
                             "logical_tokens": int(ev.kv_report()["logical_tokens"])})
            log(f"followup bound {model} doc {i}: full " + " ".join("+" if r["right"] else "-" for r in rows[-6::2])
                + ", question-known " + " ".join("+" if r["right"] else "-" for r in rows[-5::2])
                + f" ({time.perf_counter() - t0:.0f} s)")
    finally:
        full.close()
        ev.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=H.MODELS)
    ap.add_argument("--split", choices=list(R.SPLITS), default="tune")
    ap.add_argument("--docs", type=int, default=R.FULL["docs"])
    ap.add_argument("--out", default=str(HERE / "results" / "followup_bound.json"))
    args = ap.parse_args(argv)
    if args.docs < 1:
        ap.error("--docs must be >= 1")
    g = {**R.FULL, "docs": args.docs}
    commit, t0 = evidence.commit_id(), time.perf_counter()
    rows = [r for m in args.models for r in rows_for(m, g, args.split, commit)]
    for m in args.models:
        mr = [r for r in rows if r["model"] == m]
        full = {(r["doc"], r["fact"]) for r in mr if r["config"] == "full" and r["right"]}
        known = {(r["doc"], r["fact"]) for r in mr if r["config"] == "question-known" and r["right"]}
        print(f"{m} {args.split}: full {len(full)}, question-known {len(known)} ({len(full & known)} of full's)")
    settings = {**g, "budget": R.BUDGET, "depths": R.DEPTHS, "split": args.split, "threads": H.threads()}
    evidence.merge_rows(args.out, evidence.meta("full", settings, time.perf_counter() - t0, commit), rows,
                        key=lambda r: (r["model"], r["split"]), redo={(r["model"], r["split"]) for r in rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
