"""Decode speed with recall, one version of the recall module against another, paired in one process.

A full cache and two EntroKVLlama runtimes with recall on (today's defaults, 20% resident) read the same
prompt (the essays, ``--length`` tokens); one runtime's recall runs the recall module of ``--against``
(a commit: its ``entrokv_edge/runtime/recall.py``, executed on today's bindings), the other today's. Their
decoding steps are then interleaved token by token (a busy machine slows all three alike), and the rows
say each one's speed, the ratio to the full cache, whether both recall runtimes decoded the same tokens
and moved the same number of tokens (a change that keeps every decision must), and their recalls' time.

    python benchmarks/research/decode_ab.py --against 6cace8b [--model smollm2-135m] [--length 8192] [--tokens 64]

Threads: ENTROKV_BENCH_THREADS (else the machine's cores). Each run adds its row to
benchmarks/results/decode_ab.json (``--out``).

Only for recall modules that today's bindings can run (the bindings they import must still exist).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import _harness as H  # noqa: E402
import evidence  # noqa: E402
from recall import interleaved_decode  # noqa: E402
import entrokv_edge as ek  # noqa: E402


def recall_module(commit: str) -> types.ModuleType:
    """The recall module of ``commit``, executed as a module of its own (relative imports made absolute)."""
    src = subprocess.run(["git", "show", f"{commit}:entrokv_edge/runtime/recall.py"], cwd=HERE, check=True,
                         capture_output=True, text=True).stdout
    src = src.replace("from ..bindings", "from entrokv_edge.bindings")
    mod = types.ModuleType(f"recall_{commit}")
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"{commit}:entrokv_edge/runtime/recall.py", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the commit whose recall module is compared")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "decode_ab.json"),
                    help="add the row to this file (JSON: a list of rows)")
    args = ap.parse_args()
    other = recall_module(args.against)
    path = str(ek.models.model_path(args.model))
    vocab = ek.llama_cpp.Llama(path, vocab_only=True, verbose=False)
    toks = vocab.tokenize(b" ".join(f.read_bytes() for f in H.essays()[:40]))[: args.length]
    del vocab
    n_ctx = -(-(len(toks) + args.tokens + 64) // 256) * 256
    threads = H.threads()

    def runtime():
        return ek.EntroKVLlama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, budget=0.2, recall=True, verbose=False,
                               seed=0, n_threads=threads, n_threads_batch=threads)

    runs = {"full": H.load(args.model, n_ctx), "against": runtime(), "today": runtime()}
    runs["against"].recall.__class__ = other.Recall
    for llm in runs.values():
        llm.eval(toks)
    # the runtime's own recall counters after the prompt: the decode's are the difference
    before = {c: dict(llm.kv_report()["recall"]) for c, llm in runs.items() if c != "full"}
    spent, out = interleaved_decode(runs, args.tokens)
    tok_s = {c: args.tokens / spent[c] for c in runs}
    d = {c: {k: runs[c].kv_report()["recall"][k] - v[k] for k in ("recalls", "recalled_tokens", "recall_s")}
         for c, v in before.items()}
    row = {"model": args.model, "tokens": len(toks), "decoded": args.tokens, "against": args.against,
           "commit": evidence.commit_id(), "threads": threads, "tok_s": tok_s,
           "ratio": {c: tok_s[c] / tok_s["full"] for c in before},
           "same_tokens": out["against"] == out["today"], "recalls": {c: x["recalls"] for c, x in d.items()},
           "moved": {c: x["recalled_tokens"] for c, x in d.items()},
           "ms_per_recall": {c: 1e3 * x["recall_s"] / max(x["recalls"], 1) for c, x in d.items()}}
    print(json.dumps(row, indent=1))
    out_path = Path(args.out)
    rows = json.loads(out_path.read_text()) if out_path.exists() else []
    out_path.write_text(json.dumps(rows + [row], indent=1) + "\n")


if __name__ == "__main__":
    main()
