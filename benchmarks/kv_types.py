"""Against what users already have: llama.cpp's own KV quantization (-ctk / -ctv), side by side and
stacked with eviction, at equal KV bytes.

    python benchmarks/kv_types.py --parts answers,small,later,speed [--models ...] [--lengths 4096 8192 16384]
        [--prompts N] [--configs ...] [--out benchmarks/results/kv_types.json]

Configurations (name: cache type, share of the prompt kept, KV bytes against f16's full cache):

  f16            f16, the full cache (the reference)           100%
  q8_0           q8_0 K and V, the full cache                  53%
  q4_0           q4_0 K and V, the full cache                  28%
  f16@25         f16, entrokv-edge keeping 25%                 25%
  f16@50         f16, entrokv-edge keeping 50%                 50%
  q8_0@20        q8_0, entrokv-edge keeping 20% (stacked)      10.6%
  q8_0@40        q8_0, 40%                                     21%
  q8_0@50        q8_0, 50%                                     27%
  q4_0@50        q4_0, 50%                                     14%

Pairs at (about) equal bytes: f16@25 / q8_0@50 / q4_0 (25-28%), f16@50 / q8_0 (50-53%). A quantized V needs
flash attention in llama.cpp: every q8_0 and q4_0 row runs with it; f16 rows without (llama.cpp's default).

Parts:
  answers  question in the prompt: needle prompts (benchmarks/_needles.py's kinds, depths and seeds), each
           prefilled once per cache type, the full cache answering and each evicting configuration evicting
           from the same snapshot (EvictionController: window, draft, selection, compaction), then answering
           greedily (right: the needle's number in the answer); KL(f16 full || config) along f16 full's own
           greedy answer, teacher-forced (mean over its tokens)
  small    the same kind of prompt read through a small cache (EntroKVLlama with as many cells as the share
           kept, over a quarter left free: read in pieces, every eviction guided by the question)
  later    questions in later turns (benchmarks/later_turns.py's conversation, its tune documents), the
           runtime at the share kept, its defaults
  speed    one prompt of the essays per (length, configuration) in its own process: prefill and decode tok/s
           (64 greedy tokens after the eviction), KV bytes and peak RSS
  unpatched  the full caches (f16, q8_0, q4_0; and q4_0 with llama.cpp's Hadamard rotation off,
           LLAMA_ATTN_ROT_DISABLE=1) on the same needle prompts in this build and in an unpatched
           llama-cpp-python 0.3.36 (``--unpatched-python``: the interpreter of a venv where it was built from the
           same sdist, e.g. ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON ..." pip install
           llama_cpp_python-0.3.36.tar.gz``): each prompt's 16 greedy tokens and a hash of their logits, which
           are the same in both where our patch changes nothing a full cache computes

Rows merge into ``--out`` by (part, model, length, configuration). Threads: ENTROKV_BENCH_THREADS.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import entrokv_edge as ek  # noqa: E402
from entrokv_edge.runtime.host import CACHE_TYPES  # noqa: E402

import _harness as H  # noqa: E402
import _needles as NE  # noqa: E402
import fidelity as F  # noqa: E402

CONFIGS = {"f16": ("f16", None), "q8_0": ("q8_0", None), "q4_0": ("q4_0", None), "f16@25": ("f16", 0.25),
           "f16@50": ("f16", 0.5), "q8_0@20": ("q8_0", 0.2), "q8_0@40": ("q8_0", 0.4), "q8_0@50": ("q8_0", 0.5),
           "q4_0@50": ("q4_0", 0.5)}
BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}       # bytes per element (llama.cpp's block sizes)
KINDS = ["passkey", "room", "gate", "locker", "drawer", "safe"]
DEPTHS = [10, 30, 50, 70, 90]
ANSWER = 16


def kv_share(name: str) -> float:
    t, keep = CONFIGS[name]
    return BYTES[t] / BYTES["f16"] * (keep or 1.0)


def _cache(t: str) -> dict:
    return {"type_k": CACHE_TYPES[t], "type_v": CACHE_TYPES[t], "flash_attn": t != "f16"}


def prompts(llm, length: int, n: int, offset: int = 5) -> list[tuple[H.Prompt, str, dict]]:
    """n needle prompts of ``length`` tokens: kinds x depths, each its own essay offset and seed."""
    out = []
    for i in range(n):
        kind, depth = KINDS[i % len(KINDS)], DEPTHS[(i // len(KINDS)) % len(DEPTHS)]
        p, number = NE.magic_prompt(llm, length, depth, offset + i, 7000 + i, kind=kind)
        out.append((p, number, {"kind": kind, "depth": depth, "prompt": i}))
    return out


def _greedy_logprobs(llm, first: np.ndarray, n: int, stop) -> tuple[list[int], list[np.ndarray]]:
    out, lps, lg = [], [], first
    for _ in range(n):
        lps.append(F._logp(lg))
        t = int(np.argmax(lg))
        if t in stop:
            break
        out.append(t)
        llm.eval([t])
        lg = H.logits(llm)
    return out, lps


def answers_rows(model: str, length: int, n: int, configs, commit: str, log=print) -> list[dict]:
    """The answers part for one model and length."""
    rows = []
    n_ctx = -(-(length + 256) // 256) * 256
    types = sorted({CONFIGS[c][0] for c in configs} | {"f16"}, key=list(BYTES).index)
    llms = {t: H.load(model, n_ctx, **_cache(t)) for t in types}
    stop = H.stop_tokens(llms["f16"])
    for p, number, meta in prompts(llms["f16"], length, n):
        t0 = time.perf_counter()
        ref, ref_lp = None, None
        for t in types:
            llm = llms[t]
            snap = H.prefill(llm, p)["inside"]
            if t == "f16":            # the reference: f16 full's greedy answer and its distributions
                H.restore(llm, snap)
                ref, ref_lp = _greedy_logprobs(llm, snap.logits, ANSWER, stop)
                ref = ref or [int(np.argmax(snap.logits))]
            for c in configs:
                ct, keep = CONFIGS[c]
                if ct != t:
                    continue
                def cut() -> int:            # the snapshot as the configuration keeps it
                    if keep is None:
                        H.restore(llm, snap)
                        return len(p.tokens)
                    return H.evict_from(llm, snap, ek.EvictionConfig(budget=keep))["kept_tokens"]
                kept = cut()
                text = H.answer(llm, snap, "inside", p.suffix, ANSWER)
                cut()
                lp = F._follow(llm, snap.logits, ref)
                kl = float(np.mean(F._kl(ref_lp, lp)))
                rows.append({"part": "answers", "model": model, "length": length, "config": c, **meta,
                             "right": number in text, "answer": text.strip(), "number": number, "kl_mean": kl,
                             "kept_tokens": int(kept), "kv_share": kv_share(c), "commit": commit})
        log(f"answers {model} {length} #{meta['prompt']}: " + " ".join(
            f"{r['config']}{'+' if r['right'] else '-'}" for r in rows[-len(configs):])
            + f" ({time.perf_counter() - t0:.0f} s)")
    for llm in llms.values():
        llm.close()
    return rows


def small_rows(model: str, length: int, n: int, configs, commit: str, log=print) -> list[dict]:
    """The small-cache part: each prompt read through a cache of (about) the share kept."""
    from entrokv_edge.runtime.eviction import reserved_cells
    rows = []
    vocab = H.load(model, 512)
    stop = H.stop_tokens(vocab)
    for p, number, meta in prompts(vocab, length, n, offset=20):
        for c in configs:
            t, keep = CONFIGS[c]
            if keep is None:
                cells = -(-(length + 256) // 256) * 256
            else:       # capacity (cells less the quarter kept free) about the share of the prompt
                cells = max(-(-int(keep * length / 0.75) // 256) * 256, 512)
            kw = dict(n_ctx=cells, n_batch=512, n_ubatch=512, logical_ctx=length + 256, verbose=False, seed=0,
                      n_threads=H.threads(), n_threads_batch=H.threads(), **_cache(t))
            llm = ek.EntroKVLlama(str(ek.models.model_path(model)), policy="full" if keep is None else "entrokv-edge",
                                  **kw)
            t0 = time.perf_counter()
            llm.eval(p.tokens)
            toks = H.greedy(llm, H.logits(llm), ANSWER, stop)
            text = llm.detokenize(toks).decode("utf-8", errors="replace")
            rows.append({"part": "small", "model": model, "length": length, "config": c, **meta, "cells": cells,
                         "reserve": reserved_cells(cells, llm.config), "right": number in text, "answer": text.strip(),
                         "number": number, "evictions": llm.stats.evictions, "kv_share": kv_share(c),
                         "seconds": time.perf_counter() - t0, "commit": commit})
            llm.close()
        log(f"small {model} {length} #{meta['prompt']}: " + " ".join(
            f"{r['config']}{'+' if r['right'] else '-'}" for r in rows[-len(configs):]))
    vocab.close()
    return rows


def later_rows(model: str, docs: int, configs, commit: str, log=print) -> list[dict]:
    """The later-turns part: later_turns.py's conversations on its tune documents, per configuration."""
    import later_turns as LT
    from entrokv_edge.runtime.eviction import cells_to_hold
    rows = []
    full = H.load(model, max(LT.LENGTHS) + 1024)
    for i in range(docs):
        text, fs, length = LT.document(full, "tune", i)
        for c in configs:
            t, keep = CONFIGS[c]
            if keep is None:
                llm = H.load(model, max(LT.LENGTHS) + 1024, **_cache(t))
            else:
                llm = ek.EntroKVLlama(str(ek.models.model_path(model)), n_ctx=cells_to_hold(length + 1024,
                                      ek.EvictionConfig()), n_batch=512, n_ubatch=512, budget=keep, verbose=False,
                                      seed=0, n_threads=H.threads(), n_threads_batch=H.threads(), **_cache(t))
            chat = LT.Chat(llm)
            chat.ask(f"{text}\n\n{LT.INTROS[0]}", LT.TOKENS["first"])
            chat.ask(LT.UNRELATED[0], LT.TOKENS["unrelated"])
            for f in fs:
                ans, ttft = chat.ask(LT.ASK + f["question"], LT.TOKENS["question"])
                rows.append({"part": "later", "model": model, "length": length, "doc": i, "kind": f["kind"],
                             "config": c, "right": LT.right(ans, f["answer"]), "answer": ans.strip(),
                             "expected": f["answer"], "ttft_s": ttft, "kv_share": kv_share(c), "commit": commit})
            llm.close()
            log(f"later {model} doc {i} {c}: " + " ".join("+" if r["right"] else "-" for r in rows[-len(fs):]))
    full.close()
    return rows


def _speed_one(spec: dict) -> dict:
    """One speed row, in this process: prefill, the eviction (for a share), 64 decoded tokens, peak RSS."""
    import speed as S
    model, length, c = spec["model"], spec["length"], spec["config"]
    t, keep = CONFIGS[c]
    path = str(ek.models.model_path(model))
    vocab = ek.llama_cpp.Llama(path, vocab_only=True, verbose=False)
    toks = vocab.tokenize(b" ".join(f.read_bytes() for f in H.essays()[:40]))[:length]
    del vocab
    n_ctx = -(-(length + 128) // 256) * 256
    kw = dict(n_ctx=n_ctx, n_batch=512, n_ubatch=512, verbose=False, seed=0, n_threads=H.threads(),
              n_threads_batch=H.threads(), **_cache(t))
    if keep is None:
        llm = ek.llama_cpp.Llama(path, **kw)
    else:
        llm = ek.EntroKVLlama(path, budget=keep, **kw)
    t0 = time.perf_counter()
    llm.eval(toks)
    t1 = time.perf_counter()
    for _ in range(64):
        llm.eval([int(np.argmax(H.logits(llm)))])
    t2 = time.perf_counter()
    g = ek.geometry(llm)
    return {"part": "speed", "model": model, "length": length, "config": c, "prefill_tok_s": length / (t1 - t0),
            "decode_tok_s": 64 / (t2 - t1), "kv_bytes_held": int(g.n_used * g.bytes_per_cell),
            "kv_bytes_allocated": int(g.kv_size * g.bytes_per_cell), "peak_rss_mib": S._peak_rss_mib(),
            "kv_share": kv_share(c), "threads": H.threads()}


def speed_rows(model: str, lengths, configs, commit: str, log=print) -> list[dict]:
    rows = []
    for length in lengths:
        for c in configs:
            r = subprocess.run([sys.executable, __file__, "--speed-one", json.dumps(
                {"model": model, "length": length, "config": c})], capture_output=True, text=True)
            if r.returncode != 0:
                rows.append({"part": "speed", "model": model, "length": length, "config": c,
                             "error": r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else "failed",
                             "commit": commit})
            else:
                rows.append({**json.loads(r.stdout.strip().splitlines()[-1]), "commit": commit})
            log(f"speed {model} {length} {c}: " + (f"prefill {rows[-1]['prefill_tok_s']:.0f} tok/s, decode "
                                                     f"{rows[-1]['decode_tok_s']:.1f} tok/s, peak {rows[-1]['peak_rss_mib']:.0f} MiB"
                                                     if "error" not in rows[-1] else rows[-1]["error"]))
    return rows


_PLAIN = r"""
import hashlib, json, os, sys
if sys.argv[1] == "patched":
    import entrokv_edge  # noqa: F401 - binds llama_cpp to the patched libllama
import llama_cpp, numpy as np
model, prompts, t = sys.argv[2], json.load(open(sys.argv[3])), sys.argv[4]
ids = {"f16": 1, "q8_0": 8, "q4_0": 2}
n = int(os.environ.get("ENTROKV_BENCH_THREADS") or os.cpu_count())
llm = llama_cpp.Llama(model, n_ctx=int(sys.argv[5]), n_batch=512, n_ubatch=512, type_k=ids[t], type_v=ids[t],
                      flash_attn=t != "f16", verbose=False, seed=0, n_threads=n, n_threads_batch=n)
for p in prompts:
    llm.reset()
    llama_cpp.llama_memory_clear(llm._ctx.memory, True)
    llm.eval(p["tokens"])
    h, toks = hashlib.sha256(), []
    for _ in range(16):
        lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
        h.update(lg.tobytes())
        toks.append(int(np.argmax(lg)))
        llm.eval(toks[-1:])
    text = llm.detokenize(toks).decode("utf-8", "replace")
    print(json.dumps({"text": text, "right": p["number"] in text, "logits_sha256": h.hexdigest()}), flush=True)
"""


def unpatched_rows(model: str, length: int, n: int, python: str, commit: str, log=print) -> list[dict]:
    """The unpatched part: the same prompts' full caches in this build and in an unpatched llama-cpp-python."""
    import tempfile
    rows = []
    vocab = ek.llama_cpp.Llama(str(ek.models.model_path(model)), vocab_only=True, verbose=False)
    ps = [{"tokens": p.tokens, "number": number, **meta} for p, number, meta in prompts(vocab, length, n)]
    del vocab
    n_ctx = -(-(length + 64) // 256) * 256
    with tempfile.TemporaryDirectory() as tmp:
        pf, script = Path(tmp, "prompts.json"), Path(tmp, "plain.py")
        pf.write_text(json.dumps(ps))
        script.write_text(_PLAIN)
        for t, env in (("f16", {}), ("q8_0", {}), ("q4_0", {}), ("q4_0", {"LLAMA_ATTN_ROT_DISABLE": "1"})):
            got = {}
            for build, exe in (("patched", sys.executable), ("unpatched", python)):
                r = subprocess.run([exe, str(script), build, str(ek.models.model_path(model)), str(pf), t, str(n_ctx)],
                                   capture_output=True, text=True, env={**__import__("os").environ, **env})
                if r.returncode != 0:
                    raise SystemExit(f"{build} {t}: {r.stderr.strip()[-400:]}")
                got[build] = [json.loads(x) for x in r.stdout.strip().splitlines()]
            for p, a, b in zip(ps, got["patched"], got["unpatched"]):
                rows.append({"part": "unpatched", "model": model, "length": length, "config": t + ("-norot" if env else ""),
                             "prompt": p["prompt"], "kind": p["kind"], "depth": p["depth"], "number": p["number"],
                             "patched": a, "unpatched": b, "same_logits": a["logits_sha256"] == b["logits_sha256"],
                             "commit": commit})
            log(f"unpatched {model} {length} {t}{' no rotation' if env else ''}: "
                + " ".join(("=" if r["same_logits"] else "!") + ("+" if r["patched"]["right"] else "-")
                           for r in rows[-len(ps):]))
    return rows


def main(argv=None) -> int:
    import evidence
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="answers")
    ap.add_argument("--models", nargs="+", default=H.MODELS)
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096])
    ap.add_argument("--prompts", type=int, default=30, help="prompts per model and length (answers, small)")
    ap.add_argument("--docs", type=int, default=3, help="later_turns.py documents (later)")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--out", default=str(HERE / "results" / "kv_types.json"))
    ap.add_argument("--unpatched-python", help="the unpatched part's interpreter (a venv with stock llama-cpp-python)")
    ap.add_argument("--speed-one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.speed_one:
        print(json.dumps(_speed_one(json.loads(args.speed_one))))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - {"answers", "small", "later", "speed", "unpatched"}:
        ap.error("parts: answers, small, later, speed, unpatched")
    if "unpatched" in parts and not args.unpatched_python:
        ap.error("the unpatched part needs --unpatched-python")
    commit, t0 = evidence.commit_id(), time.perf_counter()
    rows = []
    for m in args.models:
        ctx = H.train_context(m)
        lengths = [n for n in args.lengths if n + 256 <= ctx]
        for length in lengths:
            if "answers" in parts:
                rows += answers_rows(m, length, args.prompts, args.configs, commit)
            if "small" in parts:
                rows += small_rows(m, length, args.prompts, args.configs, commit)
            if "unpatched" in parts:
                rows += unpatched_rows(m, length, args.prompts, args.unpatched_python, commit)
        if "later" in parts:
            rows += later_rows(m, args.docs, args.configs, commit)
        if "speed" in parts:
            rows += speed_rows(m, lengths, args.configs, commit)
    settings = {"configs": CONFIGS, "answer_tokens": ANSWER, "lengths": args.lengths, "prompts": args.prompts,
                "threads": H.threads(), "kinds": KINDS, "depths": DEPTHS}
    key = lambda r: (r["part"], r["model"], r["length"], r["config"])      # noqa: E731
    evidence.merge_rows(args.out, evidence.meta("full", settings, time.perf_counter() - t0, commit), rows, key=key,
                        redo={key(r) for r in rows})
    print(f"{len(rows)} rows -> {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
