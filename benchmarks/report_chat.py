"""REPORT.md's sections on chats and what users weigh us against: later turns (later_turns.json),
llama.cpp's KV quantization (kv_types.json) and the server under load (serve_load.json). Every
statement is computed from the rows below it; pairs are per question or per prompt (sign tests)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from _tables import _table, sign_test

LT_ORDER = ("full", "evicted", "default", "turns", "recall", "recall-lite", "reselect", "reselect+draft", "reselect+decode",
            "reread", "recon")
KV_ORDER = ("f16", "q8_0", "q4_0", "f16@25", "f16@50", "q8_0@20", "q8_0@40", "q8_0@50", "q4_0@50")


def _rows(d) -> list[dict]:
    return d["data"]["rows"] if isinstance(d["data"], dict) else d["data"]


def _paired(rows, a: str, b: str, key) -> tuple[int, int, int]:
    """Wins / losses / ties of configuration ``a`` against ``b`` on the same cases (right or not)."""
    ra = {key(r): r["right"] for r in rows if r["config"] == a}
    rb = {key(r): r["right"] for r in rows if r["config"] == b}
    both = ra.keys() & rb.keys()
    w = sum(ra[k] and not rb[k] for k in both)
    lo = sum(rb[k] and not ra[k] for k in both)
    return w, lo, len(both) - w - lo


def later_turns_section(d) -> str:
    rows, meta = _rows(d), d["meta"]
    key = lambda r: (r["model"], r["doc"], r["kind"])        # noqa: E731
    s = ["## 10. Later turns of a chat\n\n",
         "`python benchmarks/later_turns.py` (its docstring has the conversation, the documents and each round's rule): "
         "a document of 2k, 4k or 7k tokens and a summary request, an unrelated turn, then one question per fact in a "
         "turn of its own; the cache keeps 20% of the document (every later turn evicted to 20% of the conversation). "
         "Tune: essays; held out: Python's language reference, its third wording never seen in tuning. `evicted` is "
         "the default (final evictions), `turns` is `recall=\"turns\"` (round 2's candidate, run once held out), the "
         "others round 1's candidates. " + (meta.get("note", "") + ". " if meta.get("note") else "")
         + f"Held-out run: commit `{meta['commit']}`, {meta['date']}, {meta['settings'].get('threads')} threads.\n\n"]
    for split in ("tune", "heldout"):
        sr = [r for r in rows if r["split"] == split]
        if not sr:
            continue
        s.append(f"### {'Tune split' if split == 'tune' else 'Held-out split (run once)'}\n\n")
        table, goal = [], defaultdict(lambda: [0, 0])
        for model in sorted({r["model"] for r in sr}):
            mr = [r for r in sr if r["model"] == model]
            full = {key(r): r for r in mr if r["config"] == "full"}
            t_full = float(np.median([r["ttft_s"] for r in full.values()])) if full else float("nan")
            for c in [c for c in LT_ORDER if any(r["config"] == c for r in mr)]:
                cr = {key(r): r for r in mr if r["config"] == c}
                docs = len({r["doc"] for r in cr.values()})
                kept = sum(cr[k]["right"] for k in full if full[k]["right"] and k in cr)
                n_full = sum(full[k]["right"] for k in full if k in cr)
                t = float(np.median([r["ttft_s"] for r in cr.values()]))
                w, lo, ti = _paired(mr, c, "evicted", key) if c not in ("full", "evicted") else (0, 0, 0)
                table.append([model, c, docs, f"{sum(r['right'] for r in cr.values())} of {len(cr)}",
                              f"{kept} of {n_full}", t, f"{t / t_full:.2f}x" if full else "",
                              f"{w}/{lo}/{ti} (p = {sign_test(w, lo):.2g})" if c not in ("full", "evicted") else ""])
                goal[c][0] += kept
                goal[c][1] += n_full
        s.append(_table(["model", "configuration", "documents", "right", "of the full cache's right",
                         "later turns' median TTFT (s)", "vs full", "vs evicted: wins/losses/ties"], table) + "\n")
        if "turns" in goal and goal["turns"][1]:
            k, n = goal["turns"]
            per = [(r[0], r[4]) for r in table if r[1] == "turns"]
            s.append(f'`recall="turns"`, summed over models: {k} of the full cache\'s {n} right answers ({k / n:.0%}); '
                     "per model: " + ", ".join(f"{m} {x}" for m, x in per) + ".\n\n")
    return "".join(s)


def kv_types_section(d) -> str:
    rows, meta = _rows(d), d["meta"]
    s = ["## 11. Against llama.cpp's KV quantization\n\n",
         "`python benchmarks/kv_types.py` (its docstring has the configurations): llama.cpp's q8_0 and q4_0 caches, "
         "entrokv-edge on f16, and both stacked, at (about) equal KV bytes. A quantized V runs with flash attention. "
         f"Last run: commit `{meta['commit']}`, {meta['date']}, {meta['settings'].get('threads')} threads.\n\n"]
    key = lambda r: (r["model"], r["length"], r["prompt"])        # noqa: E731
    for part, title in (("answers", "Question in the prompt (each cache type prefilled once, every share evicted "
                                    "from that snapshot)"),
                        ("small", "The prompt read through a small cache")):
        pr = [r for r in rows if r["part"] == part]
        if not pr:
            continue
        s.append(f"### {title}\n\n")
        table = []
        for (model, length) in sorted({(r["model"], r["length"]) for r in pr}):
            mr = [r for r in pr if r["model"] == model and r["length"] == length]
            ref = {key(r): r["right"] for r in mr if r["config"] == "f16"}
            for c in [c for c in KV_ORDER if any(r["config"] == c for r in mr)]:
                cr = [r for r in mr if r["config"] == c]
                kept = sum(r["right"] for r in cr if ref.get(key(r)))
                w, lo, ti = _paired(mr, c, "q4_0", key) if c != "q4_0" else (0, 0, 0)
                kl = [r["kl_mean"] for r in cr if "kl_mean" in r]
                table.append([model, length, c, f"{cr[0]['kv_share']:.1%}", f"{sum(r['right'] for r in cr)} of {len(cr)}",
                              f"{kept} of {sum(ref.values())}", float(np.mean(kl)) if kl else None,
                              f"{w}/{lo}/{ti} (p = {sign_test(w, lo):.2g})" if c != "q4_0" else ""])
        s.append(_table(["model", "tokens", "configuration", "KV bytes vs f16 full", "right", "of f16 full's right",
                         "mean KL vs f16 full", "vs q4_0 full: wins/losses/ties"], table) + "\n")
    sp = [r for r in rows if r["part"] == "speed" and "error" not in r]
    if sp:
        s.append("### Speed and memory (one prompt per row, each in its own process)\n\n")
        table = []
        for (model, length) in sorted({(r["model"], r["length"]) for r in sp}):
            mr = {r["config"]: r for r in sp if r["model"] == model and r["length"] == length}
            base = mr.get("f16")
            for c in [c for c in KV_ORDER if c in mr]:
                r = mr[c]
                table.append([model, length, c, f"{r['kv_share']:.1%}", r["kv_bytes_held"] / 2 ** 20, r["prefill_tok_s"],
                              r["decode_tok_s"], f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "",
                              r["peak_rss_mib"]])
        s.append(_table(["model", "tokens", "configuration", "KV bytes vs f16", "KV MiB held", "prefill tok/s",
                         "decode tok/s", "decode vs f16 full", "peak RSS MiB"], table) + "\n")
    lr = [r for r in rows if r["part"] == "later"]
    if lr:
        s.append("### Later turns (later_turns.py's conversation, the runtime's defaults)\n\n")
        k2 = lambda r: (r["model"], r["length"], r["doc"], r["kind"])       # noqa: E731
        table = []
        for model in sorted({r["model"] for r in lr}):
            mr = [r for r in lr if r["model"] == model]
            ref = {k2(r): r["right"] for r in mr if r["config"] == "f16"}
            for c in [c for c in KV_ORDER if any(r["config"] == c for r in mr)]:
                cr = [r for r in mr if r["config"] == c]
                table.append([model, c, f"{cr[0]['kv_share']:.1%}", f"{sum(r['right'] for r in cr)} of {len(cr)}",
                              f"{sum(r['right'] for r in cr if ref.get(k2(r)))} of {sum(ref.values())}"])
        s.append(_table(["model", "configuration", "KV bytes vs f16", "right", "of f16 full's right"], table) + "\n")
    up = [r for r in rows if r["part"] == "unpatched"]
    if up:
        s.append("### The full caches in this build and in stock llama-cpp-python 0.3.36\n\n")
        table = []
        for (model, length, c) in sorted({(r["model"], r["length"], r["config"]) for r in up}):
            cr = [r for r in up if (r["model"], r["length"], r["config"]) == (model, length, c)]
            table.append([model, length, c, f"{sum(r['same_logits'] for r in cr)} of {len(cr)}",
                          f"{sum(r['patched']['right'] for r in cr)} of {len(cr)}",
                          f"{sum(r['unpatched']['right'] for r in cr)} of {len(cr)}"])
        s.append(_table(["model", "tokens", "cache", "same logits (hash of 16 greedy steps)", "right, patched",
                         "right, unpatched"], table) + "\n")
    return "".join(s)


def serve_section(d) -> str:
    x, meta = d["data"]["summary"], d["meta"]
    st = meta["settings"]
    f = lambda v, n=2: "-" if v is None else f"{v:.{n}f}"       # noqa: E731
    s = ["## 12. The server under load\n\n",
         f"`python benchmarks/serve_load.py`: {st['clients']} clients on 127.0.0.1 against `entrokv-edge serve -m "
         f"{st['model']} --kv-cells {st['kv_cells']}` ({st['threads']} threads), a mix of long documents, follow-up "
         f"turns, streaming and clients that disconnect mid-answer; then every answered conversation replayed alone on "
         f"a fresh server. Commit `{meta['commit']}`, {meta['date']}.\n\n",
         _table(["requests", "answered", "refused (503)", "failed", "disconnected on purpose", "wall (s)",
                 "replayed turns the same", "differing"],
                [[x["requests"], x["answered"], x["refused_503"], x["failed"], x["dropped_on_purpose"], f(x["wall_s"], 0),
                  x["turns_same"], x["turns_differ"]]]), "\n",
         _table(["turn", "TTFT p50 (client, s)", "p95", "p95 / p50", "TTFT p50 (server, s)", "p95"],
                [[name, f(x[f"ttft_{name}_client_p50_s"]), f(x[f"ttft_{name}_client_p95_s"]),
                  f(x[f"ttft_{name}_client_p95_s"] / x[f"ttft_{name}_client_p50_s"])
                  if x[f"ttft_{name}_client_p50_s"] else "-",
                  f(x[f"ttft_{name}_server_p50_s"]), f(x[f"ttft_{name}_server_p95_s"])] for name in ("first", "followup")]),
         f"\nThe client's time to first token includes the wait in the queue behind the other clients; the server's "
         f"(`entrokv.first_token_s`) starts when the request reaches the model. Generation: {f(x['tokens_per_s_p50'], 1)} "
         f"tok/s (median per answer). RSS {f(x['rss_mib_start'], 0)} MiB at the start, {f(x['rss_mib_max'], 0)} MiB at "
         f"most; its slope after the first quarter {f(x['rss_slope_mib_per_min'])} MiB/min (spread "
         f"{f(x['rss_slope_noise_mib'])} MiB).\n"]
    return "".join(s)


def busy_section(idle, busy) -> str:
    """Decode with recall on one thread, the machine idle and with the other core busy (recall.py --parts decode,
    run twice: numpy's BLAS held to the runtime's thread)."""
    rows = {name: {r["config"]: r for r in _rows(d)} for name, d in (("idle", idle), ("busy", busy))}
    table = []
    for c in ("full", "evicted", "recall"):
        if c in rows["idle"] and c in rows["busy"]:
            a, b = rows["idle"][c], rows["busy"][c]
            ms = [x.get("decode_recall", {}).get("ms_per_recall") for x in (a, b)]
            table.append([a["model"], c, a["decode_tok_s"], b["decode_tok_s"], f"{b['decode_tok_s'] / a['decode_tok_s']:.3f}",
                          ms[0], ms[1]])
    return ("### Decode with recall, idle and with the other core busy\n\n"
            "`ENTROKV_BENCH_THREADS=1 python benchmarks/recall.py --parts decode`, run once on an idle machine and once "
            "with a Python busy loop on the other core (8k-token prompt, 64 tokens, the full tier `recall=True`; "
            f"commits `{idle['meta']['commit']}` / `{busy['meta']['commit']}`).\n\n"
            + _table(["model", "configuration", "decode tok/s idle", "busy", "busy / idle", "ms per recall idle", "busy"],
                     table))
