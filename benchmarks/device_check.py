"""Device check: observation scores and compaction with the KV cache on a GPU, against the
CPU, and their cost at 8k/32k cached tokens against the bytes they move.

    python benchmarks/device_check.py                      # a CUDA (or other GPU) build
    python benchmarks/device_check.py --dry-run            # any build, CPU only: the same
                                                           # checks with the ggml graph path
                                                           # forced, small sizes
    python benchmarks/device_check.py --rpc 127.0.0.1:50052 --sizes 2048 4096
                                                           # the "device" is an RPC server
                                                           # (entrokv-edge rpc-server)

Run by benchmarks/device_check.sh, which builds with CUDA first. Models are synthetic
(tests/synth.py, random weights: correctness and cost, not quality), written to a temp dir.

Correctness (tiny models, r = 3 llama and r = 2 qwen2; F32 cache with V transposed and
F16 cache with flash attention): the device run's window scores against the CPU run's,
and the next-token logits after the same per-head random compaction (the device's ggml
graph path against the CPU's host path), then 8 greedy tokens.

Cost (a timing model: 8 layers, 16 query / 4 KV heads of 128, F16 cache, flash
attention): the observed window ubatch against a plain one (scoring overhead), and one
compaction keeping 20% as whole pages of 16 per (layer, KV head), against a
device-to-device copy of the kept bytes (torch, when it sees a GPU; numpy on the host
otherwise). Prints a short table last; exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import entrokv_edge as ek  # noqa: E402  (binds llama_cpp to the patched library first)
from llama_cpp import Llama  # noqa: E402
from llama_cpp import llama_cpp as C  # noqa: E402

from compaction import blob_of, keep_sets, load  # noqa: E402
from helpers import feed, greedy, random_keep  # noqa: E402
from synth import write_model  # noqa: E402

SCORE_TOL = 2e-3     # attention probabilities: GPU and CPU reduce in different orders
LOGIT_TOL = 5e-2     # logits of a random-weight model, |logit| ~ 10
CACHES = {"f32": dict(type_k=0, type_v=0, flash_attn=False), "f16fa": dict(type_k=1, type_v=1, flash_attn=True)}


def _llm(path, n_ctx, ngl, n_ubatch=512, **kw) -> Llama:
    return Llama(str(path), n_ctx=n_ctx, n_batch=max(n_ubatch, 512), n_ubatch=n_ubatch, n_gpu_layers=ngl,
                 verbose=False, seed=0, **kw)


def correctness(tmp: Path, ngl: int, force_graph: bool) -> list[dict]:
    rows = []
    models = {"llama-r3": write_model(tmp / "llama-r3.gguf", arch="llama", n_head=6, n_head_kv=2, n_layer=2, seed=3),
              "qwen2-r2": write_model(tmp / "qwen2-r2.gguf", arch="qwen2", n_head=6, n_head_kv=3, n_layer=2, seed=2)}
    rng = np.random.default_rng(0)
    prompt = [1] + list(rng.integers(3, 300, 191))
    for mname, path in models.items():
        for cname, ckw in CACHES.items():
            out = {}
            for side, n in (("cpu", 0), ("dev", ngl)):
                llm = _llm(path, 256, n, n_ubatch=256, **ckw)
                llm.eval(prompt[:-32])
                with ek.Observation(llm, 32) as obs:
                    llm.eval(prompt[-32:])
                g = ek.geometry(llm)
                keep = random_keep(np.random.default_rng(1), g.n_slots, len(prompt), 64, protect=8)
                ek.compact(llm, keep, graph=force_graph and side == "dev")
                lg = feed(llm, [40, 41, 42, 43])
                toks, _ = greedy(llm, int(np.argmax(lg)), 8)
                out[side] = (obs.last.scores, lg, toks)
                llm.close()
            ds = float(np.abs(out["dev"][0] - out["cpu"][0]).max())
            dl = float(np.abs(out["dev"][1] - out["cpu"][1]).max())
            same = out["dev"][2] == out["cpu"][2]
            rows.append(dict(model=mname, cache=cname, score_err=ds, logit_err=dl, greedy_equal=same,
                             ok=ds <= SCORE_TOL and dl <= LOGIT_TOL and same))
    return rows


def _copy_bound(nbytes: int, repeats: int) -> tuple[float, str]:
    """Median seconds of one copy of nbytes on the device (torch) or the host (numpy)."""
    try:
        import torch
        if torch.cuda.is_available():
            a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            ts = []
            for _ in range(repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                b.copy_(a)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts[1:]), "cuda memcpy (torch)"
    except ImportError:
        pass
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), "host memcpy (numpy)"


def cost(tmp: Path, sizes: list[int], ngl: int, force_graph: bool, small, repeats: int) -> list[dict]:
    if isinstance(small, str):   # a registered model (entrokv-models list)
        path = ek.models.model_path(small)
    elif small:   # CPU dry run: the same code on a model the CPU prefills in seconds
        path = write_model(tmp / "timing.gguf", n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                           n_ctx_train=65536)
    else:
        path = write_model(tmp / "timing.gguf", n_layer=8, n_head=16, n_head_kv=4, head_dim=128, n_ff=1024,
                           n_ctx_train=65536)
    rows = []
    rng = np.random.default_rng(0)
    w = 32
    for n in sizes:
        llm = _llm(path, n + 256, ngl, type_k=1, type_v=1, flash_attn=True)
        prompt = [1] + list(rng.integers(3, 300, n - 1))
        t0 = time.perf_counter()
        for i in range(0, n - w, 2048):
            llm.eval(prompt[i: min(i + 2048, n - w)])
        prefill = time.perf_counter() - t0
        mem = llm._ctx.memory

        def window(observe: bool) -> float:
            C.llama_memory_seq_rm(mem, 0, n - w, -1)
            llm.n_tokens = n - w
            t = time.perf_counter()
            if observe:
                with ek.Observation(llm, w):
                    llm.eval(prompt[-w:])
            else:
                llm.eval(prompt[-w:])
            C.llama_synchronize(llm.ctx)   # llama.cpp defers the wait for the logits
            return time.perf_counter() - t

        t_plain, t_obs = [], []
        for _ in range(repeats):
            t_plain.append(window(False))
            t_obs.append(window(True))
        g = ek.geometry(llm)
        blob = blob_of(llm)
        K = (n // 5) // 16 * 16
        keep = keep_sets(rng, g.n_slots, n, K, "pages")
        t_comp = []
        for _ in range(repeats):
            load(llm, blob)
            t = time.perf_counter()
            ek.compact(llm, keep, graph=force_graph)
            C.llama_synchronize(llm.ctx)   # graphs on an RPC backend run asynchronously
            t_comp.append(time.perf_counter() - t)
        lay = g.layers[0]
        nbytes = K * g.n_slots * (lay.head_dim_k + lay.head_dim_v) * 2   # F16 K and V rows kept
        bound, how = _copy_bound(nbytes, repeats)
        llm.close()
        rows.append(dict(tokens=n, prefill_s=prefill, window_plain_ms=1e3 * statistics.median(t_plain),
                         window_observed_ms=1e3 * statistics.median(t_obs),
                         scoring_overhead_pct=100 * (statistics.median(t_obs) - statistics.median(t_plain)) / prefill,
                         compaction_ms=1e3 * statistics.median(t_comp), kept_mib=nbytes / 2**20,
                         copy_ms=1e3 * bound, copy_kind=how,
                         ratio=statistics.median(t_comp) / bound))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", help="cached tokens (default 8192 32768; dry run 1024 2048)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="CPU only: force the graph path, small sizes")
    ap.add_argument("--rpc", metavar="HOST:PORT", help="offload to this RPC server instead of a GPU")
    ap.add_argument("--model", help="timing model: small, large (synthetic) or a registered name such as "
                    "smollm2-135m (default: small for --dry-run, else large)")
    ap.add_argument("--correctness-only", action="store_true", help="skip the cost part (e.g. under compute-sanitizer)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.rpc:
        from entrokv_edge.runtime.rpc import add_servers
        add_servers(args.rpc)
    if not args.dry_run and not C.llama_supports_gpu_offload():
        print("device_check: this build has no GPU backend (build with -DGGML_CUDA=ON, or use --dry-run)",
              file=sys.stderr)
        return 2
    ngl = 0 if args.dry_run else -1
    sizes = args.sizes or ([1024, 2048] if args.dry_run else [8192, 32768])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        checks = correctness(tmp, ngl, args.dry_run)
        choice = args.model or ("small" if args.dry_run else "large")
        small = choice == "small" if choice in ("small", "large") else choice
        costs = [] if args.correctness_only else cost(tmp, sizes, ngl, args.dry_run, small, args.repeats)
    result = dict(dry_run=args.dry_run, rpc=args.rpc, timing_model=choice, system=C.llama_print_system_info().decode(), checks=checks, cost=costs,
                  seconds=time.perf_counter() - t0)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    where = "CPU, graph path forced" if args.dry_run else f"RPC {args.rpc}" if args.rpc else "GPU"
    print(f"\ncorrectness: device ({where}) vs CPU host path")
    print(f"{'model':10} {'cache':6} {'score err':>10} {'logit err':>10} {'greedy':>7}  ok")
    for r in checks:
        print(f"{r['model']:10} {r['cache']:6} {r['score_err']:10.2e} {r['logit_err']:10.2e} "
              f"{'same' if r['greedy_equal'] else 'DIFF':>7}  {'PASS' if r['ok'] else 'FAIL'}")
    if costs:
        print(f"\ncost ({choice} timing model, F16 cache, keep 20% as pages of 16; "
              f"copy = {costs[0]['copy_kind']})")
        print(f"{'tokens':>7} {'prefill s':>9} {'window ms':>9} {'observed':>9} {'overhead':>8} "
              f"{'compact ms':>10} {'kept MiB':>8} {'copy ms':>8} {'ratio':>6}")
    for r in costs:
        print(f"{r['tokens']:7d} {r['prefill_s']:9.2f} {r['window_plain_ms']:9.2f} {r['window_observed_ms']:9.2f} "
              f"{r['scoring_overhead_pct']:7.2f}% {r['compaction_ms']:10.2f} {r['kept_mib']:8.1f} "
              f"{r['copy_ms']:8.3f} {r['ratio']:6.1f}")
    ok = all(r["ok"] for r in checks)
    print(f"\ndevice_check: {'PASS' if ok else 'FAIL'} in {result['seconds']:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
