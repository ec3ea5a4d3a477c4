"""One eviction's wall time per policy setting, on the same prefilled prompt (both models).

    python benchmarks/eviction_cost.py [--models ...] [--lengths 2048 4096 8192] [--repeats 5]
        [--prefill-cache DIR]

Per model and length: one needle prompt of benchmarks/research/variants.py's heldout4 split (depth 50)
is prefilled once with its tail observed and snapshotted (llama_state_seq_*); each setting then
restores the snapshot and evicts to 20% through EvictionController.evict (selection in numpy and the
per-head compaction), the settings interleaved round by round; medians of the rounds. Also the
native read of the value norms alone (llama_entrokv_value_norms, what value_power adds). With
lookahead (entrokv-edge's default) the timed eviction includes its draft (up to k tokens decoded with
the whole cache, then removed); "drafted": the tokens the draft decoded (it stops before the answer's end).
With --json the rows also split each eviction into the draft, the selection (scores to kept positions),
the compaction and the metrics (the head-independent replay and page accounting); report.py renders
them in section 5.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import entrokv_edge as ek  # noqa: E402

import _harness as H  # noqa: E402
from _needles import magic_prompt  # noqa: E402

SETTINGS = {"page-entrokv": dict(policy="page-entrokv"),
            "edge lookahead=0": dict(policy="entrokv-edge", lookahead=0),
            "edge lookahead=0 value_power=2": dict(policy="entrokv-edge", lookahead=0, value_power=2.0),
            "entrokv-edge (lookahead=24)": dict(policy="entrokv-edge")}       # its defaults


def main(argv=None) -> int:
    import evidence
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=H.MODELS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-cache", default=None, metavar="DIR",
                    help="reuse the prompts' snapshots kept by research/variants.py --prefill-cache DIR")
    ap.add_argument("--json", help="also write the rows here (e.g. benchmarks/results/eviction_cost.json)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    commit, t_all = evidence.commit_id(), time.perf_counter()
    print(f"{'model':18s} {'tokens':>7s} " + " ".join(f"{k + ' s':>28s}" for k in SETTINGS)
          + f" {'value norms s':>14s} {'drafted':>8s}")
    rows = []
    for model in args.models:
        llm = H.load(model, max(args.lengths) + 256)
        r = ek.llama_cpp.llama_model_n_head(llm.model) // ek.geometry(llm).layers[0].n_head_kv
        for n in [n for n in args.lengths if n <= H.train_context(model)]:
            p, _ = magic_prompt(llm, n, 50, offset=9, seed=n * 1000 + 50, kind="gate")   # research heldout4's
            snap = H.prefill_cached(llm, p, args.prefill_cache)["inside"]
            t = {k: {"total": [], "draft": [], "select": [], "compact": [], "metrics": []} for k in SETTINGS}
            norms, drafted = [], 0
            for _ in range(args.repeats):
                for name, kw in SETTINGS.items():
                    H.restore(llm, snap)
                    cfg = ek.EvictionConfig(budget=0.2, **kw)
                    ctl, stats = ek.EvictionController(cfg), {}
                    t0 = time.perf_counter()
                    scores = ctl.draft_scores(llm, snap.scores, llm.eval, stats)
                    t1 = time.perf_counter()
                    timing = ctl.evict(llm, scores).metrics["timing"]
                    t[name]["total"].append(time.perf_counter() - t0)
                    t[name]["draft"].append(t1 - t0)
                    for k in ("select", "compact", "metrics"):
                        t[name][k].append(timing[f"{k}_s"])
                    drafted = max(drafted, stats.get("drafted", 0))
                H.restore(llm, snap)
                t0 = time.perf_counter()
                ek.value_norms(llm)
                norms.append(time.perf_counter() - t0)
            med = {k: {part: statistics.median(v) for part, v in parts.items()} for k, parts in t.items()}
            print(f"{model:18s} {snap.n_tokens:7d} " + " ".join(f"{med[k]['total']:28.4f}" for k in SETTINGS)
                  + f" {statistics.median(norms):14.4f} {drafted:8d}", flush=True)
            rows += [{"model": model, "r": r, "tokens": snap.n_tokens, "setting": k, "repeats": args.repeats,
                      "drafted": drafted if "lookahead=24" in k else 0, "value_norms_s": statistics.median(norms),
                      "commit": commit, **{f"{part}_s": v for part, v in med[k].items()}} for k in SETTINGS]
        llm.close()
    if args.json:
        evidence.merge_rows(args.json, evidence.meta("full", {"lengths": args.lengths, "repeats": args.repeats,
                                                              "budget": 0.2, "threads": H.threads()},
                                                    time.perf_counter() - t_all, commit), rows,
                            key=lambda x: (x["model"], x["tokens"]), redo={(x["model"], x["tokens"]) for x in rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
