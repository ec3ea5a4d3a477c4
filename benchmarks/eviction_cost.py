"""One eviction's wall time per policy setting, on the same prefilled prompt (both models).

    python benchmarks/eviction_cost.py [--models ...] [--lengths 2048 4096 8192] [--repeats 5]
        [--prefill-cache DIR]

Per model and length: one needle prompt of benchmarks/variants.py's heldout4 split (depth 50)
is prefilled once with its tail observed and snapshotted (llama_state_seq_*); each setting then
restores the snapshot and evicts to 20% through PageEntroKV.evict (selection in numpy and the
per-head compaction), the settings interleaved round by round; medians of the rounds. Also the
native read of the value norms alone (llama_entrokv_value_norms, what value_power adds). With
lookahead (entrokv-edge's default) the timed eviction includes its draft (up to k tokens decoded with
the whole cache, then removed); "drafted": the tokens the draft decoded (it stops before the answer's end).
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
import variants as V  # noqa: E402

SETTINGS = {"page-entrokv": dict(policy="page-entrokv"),
            "edge lookahead=0": dict(policy="entrokv-edge", lookahead=0),
            "edge lookahead=0 value_power=2": dict(policy="entrokv-edge", lookahead=0, value_power=2.0),
            "entrokv-edge (lookahead=24)": dict(policy="entrokv-edge")}       # its defaults


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=H.MODELS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-cache", default=None, metavar="DIR",
                    help="reuse the prompts' snapshots kept by variants.py --prefill-cache DIR")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    print(f"{'model':14s} {'tokens':>7s} " + " ".join(f"{k + ' s':>28s}" for k in SETTINGS) + f" {'value norms s':>14s} {'drafted':>8s}")
    for model in args.models:
        llm = H.load(model, max(args.lengths) + 256)
        for n in args.lengths:
            p, _ = V.split_prompt(llm, "heldout4", n, 50)
            snap = H.prefill_cached(llm, p, args.prefill_cache)["inside"]
            t = {k: [] for k in [*SETTINGS, "norms"]}
            drafted = 0
            for _ in range(args.repeats):
                for name, kw in SETTINGS.items():
                    H.restore(llm, snap)
                    cfg = ek.EvictionConfig(budget=0.2, **kw)
                    ctl, stats = ek.PageEntroKV(cfg), {}
                    t0 = time.perf_counter()
                    ctl.evict(llm, ctl.draft_scores(llm, snap.scores, llm.eval, stats))
                    drafted = max(drafted, stats.get("drafted", 0))
                    t[name].append(time.perf_counter() - t0)
                H.restore(llm, snap)
                t0 = time.perf_counter()
                ek.value_norms(llm)
                t["norms"].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in t.items()}
            print(f"{model:14s} {snap.n_tokens:7d} " + " ".join(f"{med[k]:28.4f}" for k in SETTINGS)
                  + f" {med['norms']:14.4f} {drafted:8d}", flush=True)
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
