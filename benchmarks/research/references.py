"""The full cache's reference answers on this build: what long_prompt.py's fidelity rows are judged
against, so two builds' KL rows can be paired only where these agree.

    python benchmarks/research/references.py [--models ...] [--split fidelity|fidelity-tune] [--out F.json]
    python benchmarks/research/references.py --compare A.json B.json

Per prompt: the greedy reference (up to 64 tokens, as long_prompt.py makes it: the prompt's tail observed
as one window), its length and a hash of its tokens, and whether a plain prefill (no observation, the
same batches) gives the same last logits and the same reference. ``--compare`` lists the prompts whose
references differ between two such files, with each file's CPU features.

On 2026-12-04 (99096e0; docs/research.md, "KL depends on the build's CPU features"): on one AVX2 machine the
fidelity-tune references were equal at two commits about 100 apart, with 1 or 2 threads, and changed
with -DGGML_AVX2=OFF.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _harness as H  # noqa: E402
import fidelity  # noqa: E402
import long_prompt as LP  # noqa: E402


def references(model: str, split: str, tokens: int = LP.FULL["fid_tokens"],
               length: int = fidelity.FULL["length"]) -> list[dict]:
    """The rows of ``model``'s prompts of ``split`` (long_prompt.FIDELITY_SPLITS), on this build."""
    sp = LP.FIDELITY_SPLITS[split]
    full = H.load(model, length + tokens + 256)
    try:
        stop = H.stop_tokens(full)
        n_qa, n_code = sp.get("n_qa", fidelity.FULL["n_qa"]), sp.get("n_code", fidelity.FULL["n_code"])
        rows = []
        for p in fidelity.qa_prompts(full, n_qa, length, sp["qa_offset"]) + \
                fidelity.code_prompts(full, n_code, length, sp["code_offset"]):
            snap, ref, _ = LP.fidelity_reference(full, p, tokens, stop)
            H.C.llama_memory_clear(full._ctx.memory, True)
            full.reset()
            full.eval(p.tokens)             # (llama-cpp-python decodes it in batches of n_batch)
            plain = H.logits(full)
            plain_ref = H.greedy(full, plain, tokens, stop) or [int(np.argmax(plain))]
            rows.append({"model": model, "split": split, "source": p.meta["source"], "prompt_tokens": len(p.tokens),
                         "prompt_sha": hashlib.sha256(np.asarray(p.tokens, np.int64).tobytes()).hexdigest()[:16],
                         "ref_tokens": len(ref),
                         "ref_sha": hashlib.sha256(np.asarray(ref, np.int64).tobytes()).hexdigest()[:16],
                         "plain_same": plain_ref == ref, "plain_max_diff": float(np.abs(plain - snap.logits).max())})
        return rows
    finally:
        full.close()


def compare(a: dict, b: dict) -> list[str]:
    """Lines: each prompt (model, split, source) of both files whose prompt or reference differs."""
    key = lambda r: (r["model"], r["split"], r["source"])  # noqa: E731
    rb = {key(r): r for r in b["rows"]}
    out = []
    for r in a["rows"]:
        o = rb.get(key(r))
        if o is None:
            continue
        if o["prompt_sha"] != r["prompt_sha"]:
            out.append(f"{' '.join(key(r))}: other prompt tokens")
        elif o["ref_sha"] != r["ref_sha"]:
            out.append(f"{' '.join(key(r))}: reference {r['ref_tokens']} tokens against {o['ref_tokens']}, other tokens")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"], choices=H.MODELS)
    ap.add_argument("--split", default="fidelity-tune", choices=sorted(LP.FIDELITY_SPLITS))
    ap.add_argument("--out", default=None, help="write the rows and this build's CPU features here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two files this script wrote")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.compare)
        print(f"A: {a['cpu_features']}\nB: {b['cpu_features']}")
        diff = compare(a, b)
        print("\n".join(diff) if diff else "the same references on every prompt both hold")
        return 0
    rows = [r for m in args.models for r in references(m, args.split)]
    for r in rows:
        print(f"{r['model']} {r['source']}: reference {r['ref_tokens']} tokens ({r['ref_sha']}), "
              f"plain prefill {'the same' if r['plain_same'] else 'OTHER'} (max diff {r['plain_max_diff']:.3g})")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu_features": H.cpu_features(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
