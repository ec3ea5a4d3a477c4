"""Speed and memory: a full cache against EntroKVLlama at 20%, side by side.

    python benchmarks/speed.py [--quick] [--model smollm2-135m] [--repeats 3]
                               [--policies page-entrokv entrokv-edge] [--json out.json]

Every measurement runs in its own process (its peak RSS is the process's), on the same
real text (the essays, concatenated), for each evicting policy (the method, page-entrokv,
and the default, entrokv-edge):
- prefill of N = 2k/4k/8k tokens with a plain llama.cpp cache, and with EntroKVLlama
  (same cache size, the last 32 tokens observed, then evicted to 20%): the overhead of
  scoring and compaction as a share of the plain prefill, and the eviction's own wall
  time; then 32 greedy tokens decoded on each cache (full vs 20%). ``--repeats`` rounds,
  each running plain and every policy in turn, each round starting with the next one, so
  that drift on a shared machine and the order hit them alike (the report takes medians);
- a prompt of 16k tokens through a 2048-cell EntroKVLlama cache (budget 1024) against the
  full 16k cache (once); the evictions between its pieces are guided by its last tokens (the
  option guide), whose cost is reported apart (guide_s).
The modes "entrokv-edge+recall" and "entrokv-edge+recall-file" (``--policies``) run the default with
the recall tier on, its store in host memory or in a file (a temporary directory): their decode
includes the recalls every 4 tokens, whose own wall time is reported apart (recall_s), and their
memory the store's bytes (store_bytes, and store_bytes_in_memory).
KV bytes: what llama.cpp allocated for the cache, and what the page accounting says is
held after the last eviction.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

FULL = dict(lengths=[2048, 4096, 8192], long=16384, long_cells=2048, long_budget=1024, repeats=3)
QUICK = dict(lengths=[512], long=2048, long_cells=512, long_budget=256, repeats=1)
POLICIES = ("page-entrokv", "entrokv-edge")
RECALL_MODES = ("entrokv-edge+recall", "entrokv-edge+recall-file")


def _peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve,
    so a child of a big parent would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one(spec: dict) -> dict:
    """One measurement, in this process."""
    import entrokv_edge as ek
    import _harness as H
    path = str(ek.models.model_path(spec["model"]))
    vocab = ek.llama_cpp.Llama(path, vocab_only=True, verbose=False)
    text = b" ".join(f.read_bytes() for f in H.essays()[:40])
    toks = vocab.tokenize(text)[: spec["tokens"]]
    del vocab
    if spec["mode"] == "plain":
        llm = ek.llama_cpp.Llama(path, n_ctx=spec["cells"], n_batch=512, verbose=False, seed=0,
                                 n_threads=H.threads(), n_threads_batch=H.threads())
    else:
        import tempfile
        policy, _, recall = spec["mode"].partition("+")
        store_dir = tempfile.mkdtemp(prefix="entrokv-speed-") if recall == "recall-file" else None
        llm = ek.EntroKVLlama(path, n_ctx=spec["cells"], n_batch=512, budget=spec["budget"], policy=policy,
                              verbose=False, seed=0, recall={"directory": store_dir} if recall else None,
                              logical_ctx=spec["tokens"] + 256, n_threads=H.threads(), n_threads_batch=H.threads())
    t0 = time.perf_counter()
    llm.eval(toks)                       # EntroKVLlama evicts to the budget after the prompt
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = len(H.greedy(llm, H.logits(llm), 32, stop=set()))
    decode = time.perf_counter() - t0
    g = ek.geometry(llm)
    out = {**spec, "prefill_s": prefill, "prefill_tok_s": len(toks) / prefill, "decode_tok_s": n / decode,
           "kv_bytes_allocated": g.kv_size * g.bytes_per_cell, "kv_cells": g.kv_size,
           "kv_bytes_held": g.n_used * g.bytes_per_cell,
           "peak_rss_mib": _peak_rss_mib()}
    if spec["mode"] != "plain":
        rep = llm.kv_report()
        out.update(evictions=rep["evictions"], eviction_s=rep["eviction_s"], kept_tokens=rep["kept_tokens"],
                   kv_bytes_full=rep["kv_bytes_full"], kv_bytes_kept=rep["kv_bytes_kept"],
                   guided_evictions=rep["guided_evictions"], guide_s=rep["guide_s"],
                   drafted_tokens=rep["drafted_tokens"])
        if rep["recall"]["on"]:
            out.update({f"recall_{k}": v for k, v in rep["recall"].items()})
    llm.close()
    return out


def measure(spec: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                       cwd=Path(__file__).parent)
    if r.returncode != 0:
        raise RuntimeError(f"speed measurement {spec} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(model: str, lengths, long: int, long_cells: int, long_budget: int, repeats: int = 1,
        policies=POLICIES, log=print) -> list[dict]:
    """Rows: one per process; ``mode`` is "plain" or the evicting policy, ``rep`` the round."""
    rows = []
    for n in lengths:
        cells = -(-(n + 64) // 256) * 256
        for rep in range(repeats):
            got, modes = {}, ["plain", *policies]
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:     # each round starts elsewhere
                got[mode] = measure({"part": "prefill", "model": model, "mode": mode, "tokens": n, "cells": cells,
                                     "budget": 0.2, "rep": rep})
                rows.append(got[mode])
            log(f"speed {model} {n} round {rep + 1}/{repeats}: prefill " + ", ".join(
                f"{m} {got[m]['prefill_s']:.1f} s" for m in modes) + "; decode " + ", ".join(
                f"{got[m]['decode_tok_s']:.1f}" for m in modes) + " tok/s")
    for mode in policies:
        rows.append(measure({"part": "long", "model": model, "mode": mode, "tokens": long, "cells": long_cells,
                             "budget": long_budget, "rep": 0}))
    rows.append(measure({"part": "long", "model": model, "mode": "plain", "tokens": long,
                         "cells": -(-(long + 64) // 256) * 256, "budget": None, "rep": 0}))
    log(f"speed {model} long {long}: done")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, help="rounds of the prefill runs (default: 3, --quick: 1)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES + RECALL_MODES)
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--lengths", type=int, nargs="+", help="prefill lengths (default: 2k, 4k, 8k; --quick 512)")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(_one(json.loads(args.one))))
        return 0
    g = QUICK if args.quick else FULL
    repeats = g["repeats"] if args.repeats is None else args.repeats
    if repeats < 1:
        ap.error("--repeats must be at least 1")
    rows = run(args.model, args.lengths or g["lengths"], g["long"], g["long_cells"], g["long_budget"], repeats,
               args.policies)
    for r in rows:
        print(f"{r['part']:7} {r['mode']:12} {r['tokens']:6d} tokens, {r['kv_cells']:6d} cells: prefill "
              f"{r['prefill_tok_s']:6.0f} tok/s, decode {r['decode_tok_s']:5.1f} tok/s, KV allocated "
              f"{r['kv_bytes_allocated'] / 2**20:6.1f} MiB, held {r['kv_bytes_held'] / 2**20:6.1f} MiB, "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
