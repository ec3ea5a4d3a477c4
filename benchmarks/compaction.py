"""Compaction time vs the memcpy bound, SmolLM2-135M, keeping 20% of 2k/4k/8k cached tokens.

    python benchmarks/compaction.py [--lengths 2048 4096 8192] [--keep 0.2] [--repeats 5] [--json out.json]

The prompt is prefilled once per cache layout (flash attention off: V transposed; on:
V in rows) and snapshotted with llama_state_seq_get_data; every measurement reloads
that snapshot, truncates it to the length with seq_rm, and times one compaction with
a different random keep set per (layer, KV head): either whole pages of 16 tokens (what
Page-EntroKV keeps) or scattered single tokens (the worst case for a gather). The bound is a plain memcpy of the
kept K+V bytes (numpy copyto between two preallocated buffers of that size), measured
both warm (the same buffers copied again and again, so they sit in the caches) and cold
(a 64 MiB scratch buffer is written before each copy, as the reload of the snapshot does
before each compaction). The figure to read is the ratio of the median compaction time to
the median cold memcpy; the ratio to the warm memcpy is printed beside it.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np

import entrokv_edge as ek
from entrokv_edge.models import model_path
from llama_cpp import Llama
from llama_cpp import llama_cpp as C

from _timing import median_seconds


def blob_of(llm) -> bytes:
    size = C.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    return bytes(buf[: C.llama_state_seq_get_data(llm.ctx, buf, size, 0)])


def load(llm, blob: bytes) -> None:
    C.llama_memory_clear(llm._ctx.memory, True)
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    assert C.llama_state_seq_set_data(llm.ctx, buf, len(blob), 0) == len(blob)


PAGE = 16


def keep_sets(rng, n_slots: int, n: int, K: int, pattern: str) -> np.ndarray:
    """int32 [n_slots, K]: sorted random cells per slot, as whole pages or single tokens."""
    if pattern == "pages":
        pages = [np.sort(rng.choice(n // PAGE, K // PAGE, replace=False)) for _ in range(n_slots)]
        return np.stack([(p[:, None] * PAGE + np.arange(PAGE)).ravel() for p in pages]).astype(np.int32)
    return np.sort(np.stack([rng.choice(n, K, replace=False) for _ in range(n_slots)]), axis=1).astype(np.int32)


_SCRATCH = np.zeros(64 << 20, dtype=np.uint8)


def memcpy_seconds(nbytes: int, repeats: int, cold: bool) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    ts = []
    for _ in range(max(repeats, 5)):
        if cold:
            np.add(_SCRATCH, 1, out=_SCRATCH)   # evict src and dst from the caches
        ts.append(median_seconds(lambda: np.copyto(dst, src), 1))
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--keep", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    path = model_path(args.model)
    n_max = max(args.lengths)
    rng = np.random.default_rng(0)
    rows = []
    for fa in (False, True):
        llm = Llama(str(path), n_ctx=n_max + 256, n_batch=512, n_ubatch=512, flash_attn=fa, verbose=False)
        toks = [int(t) for t in rng.integers(100, llm.n_vocab() - 100, n_max)]
        t0 = time.perf_counter()
        llm.eval(toks)
        print(f"# prefill {n_max} tokens (flash_attn={fa}): {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        snap = blob_of(llm)
        g = ek.geometry(llm)
        for n in args.lengths:
            K = int(n * args.keep) // PAGE * PAGE
            kept_bytes = K * g.bytes_per_cell
            for pattern, path_name in [(p, q) for p in ("pages", "tokens") for q in ("host", "graph")]:
                def one_compaction():
                    load(llm, snap)
                    assert llm._ctx.kv_cache_seq_rm(0, n, -1)
                    keep = keep_sets(rng, g.n_slots, n, K, pattern)
                    t0 = time.perf_counter()
                    ek.compact(llm, keep, graph=(path_name == "graph"))
                    assert ek.geometry(llm).n_used == K
                    return time.perf_counter() - t0

                t_c = statistics.median(one_compaction() for _ in range(args.repeats))
                t_cold = memcpy_seconds(kept_bytes, args.repeats, cold=True)
                t_warm = memcpy_seconds(kept_bytes, args.repeats, cold=False)
                rows.append(dict(flash_attn=fa, v_trans=g.v_trans, pattern=pattern, path=path_name, cached=n, kept=K,
                                 kept_mib=kept_bytes / 2**20, compact_ms=t_c * 1e3, memcpy_cold_ms=t_cold * 1e3,
                                 memcpy_warm_ms=t_warm * 1e3, ratio=t_c / t_cold, ratio_warm=t_c / t_warm))

    print(f"{'V layout':10s} {'keep':6s} {'path':6s} {'cached':>7s} {'kept':>6s} {'kept MiB':>9s} "
          f"{'compact ms':>11s} {'memcpy cold':>12s} {'ratio':>6s} {'memcpy warm':>12s} {'ratio':>6s}")
    for r in rows:
        print(f"{'transposed' if r['v_trans'] else 'rows':10s} {r['pattern']:6s} {r['path']:6s} {r['cached']:7d} {r['kept']:6d} "
              f"{r['kept_mib']:9.2f} {r['compact_ms']:11.2f} {r['memcpy_cold_ms']:12.3f} {r['ratio']:6.1f} "
              f"{r['memcpy_warm_ms']:12.3f} {r['ratio_warm']:6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
