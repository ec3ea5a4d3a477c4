"""Scoring overhead as a share of prefill, and the controller's selection time (SmolLM2).

    python benchmarks/scoring.py [--lengths 2048 4096 8192] [--window 32] [--repeats 7]

One prefill to the longest length, timed at every length on the way. At each length n,
the last w tokens are then decoded again as one ubatch, with and without observation
(the window ubatch is removed with seq_rm between runs), and the extra time of the
observed ubatch is reported as a share of the prefill time of n tokens. Selection time
is measured on the real observed scores at n, for the Python controller (page-entrokv
policy) and the C selector.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import entrokv_edge as ek
from entrokv_edge.bindings import select_pages_native
from entrokv_edge.controller import select
from entrokv_edge.models import model_path
from llama_cpp import Llama

from _timing import median_seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--flash-attn", action="store_true")
    args = ap.parse_args()
    w = args.window
    lengths = sorted(args.lengths)
    llm = Llama(str(model_path(args.model)), n_ctx=lengths[-1] + 256, n_batch=512, n_ubatch=512,
                flash_attn=args.flash_attn, verbose=False)
    toks = [int(t) for t in np.random.default_rng(0).integers(100, llm.n_vocab() - 100, lengths[-1])]

    prefill_s, done, t_total = {}, 0, 0.0
    for n in lengths:                       # prefill up to n - w, timing the way there
        t0 = time.perf_counter()
        llm.eval(toks[done: n - w])
        t_total += time.perf_counter() - t0
        done = n - w
        prefill_s[n] = t_total              # completed below with the window ubatch itself
        llm.eval(toks[n - w: n])            # (re-done and timed per variant below)
        assert llm._ctx.kv_cache_seq_rm(0, n - w, -1)
        llm.n_tokens = n - w

    rows = []
    for n in reversed(lengths):             # longest first: each length truncates the cache further
        assert llm._ctx.kv_cache_seq_rm(0, n - w, -1)
        llm.n_tokens = n - w

        def window_ubatch(observe):
            def run():
                if observe:
                    with ek.Observation(llm, w):
                        llm.eval(toks[n - w: n])
                else:
                    llm.eval(toks[n - w: n])
                assert llm._ctx.kv_cache_seq_rm(0, n - w, -1)
                llm.n_tokens = n - w
            return run

        t_plain = median_seconds(window_ubatch(False), args.repeats)
        t_obs = median_seconds(window_ubatch(True), args.repeats)
        with ek.Observation(llm, w) as obs:
            llm.eval(toks[n - w: n])
        s = obs.last.scores[:, :, :n]
        cfg = ek.EvictionConfig(budget=0.2, window=w, policy="page-entrokv")
        t_sel = median_seconds(lambda: select(s, 3, cfg), args.repeats)
        t_c = median_seconds(lambda: select_pages_native(s, 3, budget=int(0.2 * n)), args.repeats)
        assert llm._ctx.kv_cache_seq_rm(0, n - w, -1)
        llm.n_tokens = n - w
        prefill = prefill_s[n] + t_plain
        rows.append((n, prefill, t_plain, t_obs, (t_obs - t_plain) / prefill, t_sel, t_c))
    rows.sort()

    print(f"{'tokens':>7s} {'prefill s':>10s} {'window ms':>10s} {'observed ms':>12s} {'overhead':>9s} "
          f"{'select ms (py)':>15s} {'select ms (C)':>14s}")
    for n, pre, tp, to, ov, ts, tc in rows:
        print(f"{n:7d} {pre:10.1f} {tp * 1e3:10.1f} {to * 1e3:12.1f} {ov * 100:8.2f}% {ts * 1e3:15.2f} {tc * 1e3:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
