"""A prompt far longer than the cache: 16k tokens through a 2048-cell cache (SmolLM2).

    python benchmarks/long_prompt.py [--tokens 16384] [--kv-cells 2048] [--budget 1024]

Prints the logical and kept tokens, the evictions, the KV bytes of a full cache vs those
held, the prefill speed and the peak RSS of the process.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np

import entrokv_edge as ek


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--kv-cells", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=1024)
    args = ap.parse_args()
    llm = ek.EntroKVLlama(str(ek.models.model_path(args.model)), n_ctx=args.kv_cells, budget=args.budget,
                          logical_ctx=args.tokens + 1024, verbose=False)
    toks = [int(t) for t in np.random.default_rng(0).integers(100, llm.n_vocab() - 100, args.tokens)]
    t0 = time.perf_counter()
    llm.eval(toks)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(64):
        llm.eval([int(np.argmax(np.ctypeslib.as_array(ek.llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                                        shape=(llm.n_vocab(),))))])
    t_decode = time.perf_counter() - t0
    rep = llm.kv_report()
    mib = 1 << 20
    print(f"logical tokens {rep['logical_tokens']}, kept {rep['kept_tokens']} in {rep['kv_cells']} cells, "
          f"{rep['evictions']} evictions")
    print(f"KV: {rep['kv_bytes_full'] / mib:.1f} MiB for a full cache, {rep['kv_bytes_allocated'] / mib:.1f} MiB "
          f"allocated, {rep['kv_bytes_kept'] / mib:.1f} MiB held")
    print(f"prefill {args.tokens / t_prefill:.0f} tok/s ({t_prefill:.1f} s), decode {64 / t_decode:.1f} tok/s, "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
