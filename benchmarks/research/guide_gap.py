"""Where the guided read loses against one eviction: its selection, or the keys and values of the
tokens it read after evictions (issue 22's fidelity goal).

    python benchmarks/research/guide_gap.py [--quick] [--models smollm2-135m] [--configs piecewise guided]
        [--out benchmarks/research/results/guide_gap.json]

The fidelity judge's prompts (benchmarks/long_prompt.py's fidelity part: 2k tokens, the question at
the end, read through a cache of a quarter of their length; KL(full || evicted) along the full
cache's 64-token greedy answer). Per prompt:
  one eviction  the whole prompt in a full cache, evicted once after it to what the small cache
                keeps (S: the positions each (layer, KV head) buffer keeps)
  <config>      the prompt read in pieces through the small cache (long_prompt.CONFIGS)
  <config>/exact-kv
                that read's kept positions T, per buffer, cut out of the full cache's prefill:
                its selection, with the keys and values one eviction has (what the read loses
                by its selection alone)
  oracle        the prompt read in pieces with S favoured at every eviction (a large bonus on S's
                positions, per buffer): one eviction's selection, as far as a read in pieces can
                hold it, with the keys and values computed after evictions (what the read loses
                by reading through a small cache alone)
and the share of S each read keeps (overlap). The oracle is a bound, not a method: S needs the
whole prompt in a cache.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import entrokv_edge as ek  # noqa: E402
from entrokv_edge.controller import Favour  # noqa: E402
from entrokv_edge.runtime.eviction import capacity_pages  # noqa: E402

import _harness as H  # noqa: E402
import fidelity  # noqa: E402
import long_prompt as LP  # noqa: E402

_favour = {"mask": None}        # [L, G, n] bool: positions whose scores get the bonus, per buffer


def favoured(policy):
    """``policy`` with the oracle's bonus: the positions of _favour["mask"] (while it is set) gain 1e3 at every
    eviction made layer by layer."""
    return Favour(policy, lambda: _favour["mask"], bonus=1e3)



def _kept(llm) -> list[np.ndarray]:
    """Per (layer, KV head) buffer, the true positions it holds, ascending."""
    return [np.sort(row[row >= 0]) for row in ek.true_positions(llm)]


def _overlap(a: list[np.ndarray], s: list[np.ndarray]) -> float:
    return float(np.mean([len(np.intersect1d(x, y)) / max(len(y), 1) for x, y in zip(a, s)]))


def run(models, configs, length: int, n_qa: int, n_code: int, tokens: int, log=print) -> list[dict]:
    rows = []
    cells = length // 4
    LP.WRAP = favoured      # every read of long_prompt.py's runtimes evicts with the favoured policy (no mask: as is)
    for model in models:
        small = LP._runtime(model, cells, length + tokens + 256)
        full = H.load(model, length + tokens + 256)
        stop = H.stop_tokens(full)
        budget = capacity_pages(small) * small.config.page_size
        g = ek.geometry(small)
        L, G = len(g.layers), g.layers[0].n_head_kv
        for p in fidelity.qa_prompts(full, n_qa, length) + fidelity.code_prompts(full, n_code, length):
            t0 = time.perf_counter()
            snap, ref, full_lp = LP.fidelity_reference(full, p, tokens, stop)

            def kl(lp):
                return float(np.mean(fidelity._kl(full_lp, lp)))
            H.evict_from(full, snap, ek.EvictionConfig(budget=budget))
            S = _kept(full)
            row = {"model": model, "kind": p.meta["kind"], "source": p.meta["source"], "prompt_tokens": len(p.tokens),
                   "cells": cells, "kept_tokens": len(S[0]), "one eviction": kl(fidelity._follow(full, snap.logits, ref))}
            for name in configs:
                LP._read(small, p.tokens, ek.EvictionConfig(**LP.CONFIGS[name]))
                T = _kept(small)
                row[f"{name} overlap"] = _overlap(T, S)
                row[name] = kl(fidelity._follow(small, H.logits(small), ref))
                H.restore(full, snap)
                k = min(len(t) for t in T)
                ek.compact(full, np.stack([t[:k] for t in T]).astype(np.int32))
                row[f"{name}/exact-kv"] = kl(fidelity._follow(full, snap.logits, ref))
            mask = np.zeros((L, G, len(p.tokens) + 1), dtype=bool)
            for slot, pos in enumerate(S):
                mask[slot // G, slot % G, pos] = True
            _favour["mask"] = mask
            try:
                # the favour is per buffer; a consensus (guide_consensus) would put pages into every buffer alike
                LP._read(small, p.tokens, ek.EvictionConfig(guide_consensus=0.0))
            finally:
                _favour["mask"] = None
            row["oracle overlap"] = _overlap(_kept(small), S)
            row["oracle"] = kl(fidelity._follow(small, H.logits(small), ref))
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            log(f"guide gap {model} {p.meta['source']}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float) and k != "seconds"))
        full.close()
        small.close()
    return rows


def main(argv=None) -> int:
    import evidence
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--configs", nargs="+", default=["piecewise", "guided"],
                    choices=[c for c in LP.CONFIGS if "guide_from" not in LP.CONFIGS[c]])
    ap.add_argument("--out", default=str(HERE / "results" / "guide_gap.json"))
    args = ap.parse_args(argv)
    f = fidelity.QUICK if args.quick else fidelity.FULL
    commit, t0 = evidence.commit_id(), time.perf_counter()
    rows = run(args.models, args.configs, f["length"], f["n_qa"], f["n_code"], 8 if args.quick else 64)
    keys = ["one eviction"] + [k for c in args.configs for k in (c, f"{c}/exact-kv")] + ["oracle"]
    means = {m: {k: float(np.mean([r[k] for r in rows if r["model"] == m])) for k in keys} for m in args.models}
    doc = {"meta": evidence.meta("quick" if args.quick else "full", {"threads": H.threads(), "configs": args.configs},
                                 time.perf_counter() - t0, commit), "data": {"rows": rows, "means": means}}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(means, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
