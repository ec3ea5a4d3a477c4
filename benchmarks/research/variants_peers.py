"""Issue 7's peers on variants.py's prompts: kvpress's SnapKV, StreamingLLM and ExpectedAttention
presses, their answers graded as variants.py grades ours, and their KL(full || compressed) along
the full cache's answer (nats, mean over the answer), the number issue 7 compares.

    python benchmarks/research/variants_peers.py [--split tune|heldout|heldout2|heldout3|heldout4|both] [--lengths 2048 4096 8192]
        [--models smollm2-135m [gemma3-270m]] [--systems kvpress-snapkv,...] [--budgets 0.2]
        [--depths ...] [--threads N] [--quick] [--out benchmarks/research/results/variants_peers.json]

The prompts are variants.py's (the same split, length, depth, needle, haystack and question);
each is handed to benchmarks/peers.py in the peers' environment (.venv-peers, built by
benchmarks/peers_env.sh) as its context text and question, placement "inside" (the question is
part of what kvpress compresses, as it is part of the observed window in variants.py), budget
0.2, up to 24 answer tokens, with "kl" on. The full cache's reference and the KL are kvpress's
own: greedy decoding on kvpress's uncompressed cache of the same prompt, then each press's
next-token distributions teacher-forced along it (see peers.py). Rows: variants.json's keys
where they apply (config = the peer system's name), merged into --out per (model, split, length, depth, config,
budget): a rerun replaces the rows it produces again and keeps the rest. Each row carries its
own commit; the file's meta (settings, date) is the last run's.

Gemma 3 270M: transformers (5.2) reads the GGUF's weights (its logits match llama.cpp's) but
turns its SentencePiece-BPE tokenizer into a Unigram one that splits words wrongly
(transformers#41494), so its token ids come from llama.cpp (the GGUF's own tokenizer), framed as
kvpress's pipe.preprocess frames a model without a chat template (BOS + context, "\\n" before
the answer). kvpress does not list Gemma3ForCausalLM among its tested models and compresses all
of its layers, the sliding-window ones too (it skips those only for Gemma3ForConditionalGeneration).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))        # the benchmarks' shared modules

import entrokv_edge as ek  # noqa: E402

import _harness as H  # noqa: E402
import evidence  # noqa: E402
import peers  # noqa: E402  (stdlib-only at import: its torch / OpenVINO imports are inside the systems)
import variants  # noqa: E402

SYSTEMS = ["kvpress-snapkv", "kvpress-streaming", "kvpress-expected"]
LENGTHS = [2048, 4096, 8192]
MAX_NEW = 24
PLACEMENT = "inside"
# Models whose token ids peers.py gets from here (llama.cpp, the GGUF's own tokenizer), and why.
TOKEN_IDS = {
    "gemma3-270m": ("transformers 5.2 loads the Gemma 3 270M GGUF (Gemma3ForCausalLM, float32; its logits match "
                    "llama.cpp's) but converts its SentencePiece-BPE tokenizer to a Unigram model that splits words "
                    "wrongly ('The capital' -> 'The', '▁c', 'ap', 'it', 'al'; transformers#41494), so kvpress gets "
                    "llama.cpp's token ids, framed as its pipe.preprocess frames a model without a chat template "
                    "(BOS + context; '\\n' before the answer). kvpress 0.5.5 does not list Gemma3ForCausalLM among "
                    "its tested models and compresses every layer, the 15 sliding-window (512) ones too (it skips "
                    "those only for Gemma3ForConditionalGeneration)"),
}


def token_ids(llm, context: str, question: str, placement: str) -> dict:
    """kvpress's context / question ids (pipe.preprocess for a model without a chat template: BOS +
    context, question + "\\n"), tokenized by llama.cpp."""
    if llm.metadata.get("tokenizer.chat_template"):
        raise NotImplementedError("token ids from llama.cpp are built for models without a chat template only")
    ctx, q = (context + peers.QA_SEP + question, "") if placement == "inside" else (context, peers.QA_SEP + question)
    tok = lambda s: llm.tokenize(s.encode(), add_bos=False, special=False)  # noqa: E731
    return {"context_ids": [int(llm.token_bos())] + tok(ctx), "question_ids": tok(q + "\n")}


def cases_for(model: str, splits, lengths, depths, budgets, log=print):
    llm = H.load(model, max(lengths) + 256)
    cases, info = [], {}
    try:
        for split in splits:
            for length in lengths:
                for depth in (depths or variants.SPLITS[split]["depths"]):
                    p, check = variants.split_prompt(llm, split, length, depth)
                    context, question, n_llama = p.meta["context"], p.meta["question"], len(p.tokens)
                    ids = token_ids(llm, context, question, PLACEMENT) if model in TOKEN_IDS else {}
                    for b in budgets:
                        cid = f"{split}-{length}-{depth}-{b:g}"
                        cases.append({"id": cid, "context": context, "question": question, "budget": b,
                                      "placement": PLACEMENT, "max_new_tokens": MAX_NEW, "kl": True, **ids})
                        info[cid] = dict(split=split, length=length, depth=depth, check=check,
                                         llama_prompt_tokens=n_llama)
    finally:
        llm.close()
    log(f"variants_peers {model}: {len(cases)} cases")
    return cases, info


def run_peers(model: str, cases: list[dict], systems, threads: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        inp, res = Path(tmp) / "cases.jsonl", Path(tmp) / "rows.jsonl"
        inp.write_text("".join(json.dumps(c) + "\n" for c in cases))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
        r = subprocess.run([str(evidence.PEERS_VENV), str(HERE.parent / "peers.py"), "--gguf",
                            str(ek.models.model_path(model)), "--in", str(inp), "--out", str(res),
                            "--threads", str(threads), "--systems", ",".join(systems), "--kl"], env=env)
        if r.returncode != 0 or not res.exists():
            raise SystemExit(f"peers.py failed ({r.returncode}) on {model}")
        return [json.loads(ln) for ln in res.read_text().splitlines() if ln.strip()]


def rows_for(model: str, peer_rows: list[dict], info: dict, commit: str) -> list[dict]:
    rows = []
    for pr in peer_rows:
        c = info[pr["id"]]
        ok = not pr.get("skipped")
        ref = pr.get("reference_answer")
        rows.append({
            "model": model, "split": c["split"], "length": c["length"], "depth": c["depth"],
            "config": pr["system"], "budget": pr["budget"], "placement": pr["placement"],
            "correct": c["check"](pr.get("answer") or "") if ok else None, "answer": pr.get("answer"),
            "kl_mean": pr.get("kl_mean"), "agreement": pr.get("agreement"), "kl_steps": pr.get("kl_steps"),
            "kl_per_step": pr.get("kl_per_step"), "reference_answer": ref,
            "reference_correct": c["check"](ref) if isinstance(ref, str) else None,
            "kept_tokens": pr.get("kept_tokens"), "prompt_tokens": pr.get("prompt_tokens"),
            "llama_prompt_tokens": c["llama_prompt_tokens"], "peak_cache_tokens": pr.get("peak_cache_tokens"),
            "press": pr.get("press"), "press_params": pr.get("press_params"),
            "token_ids": pr.get("token_ids", "kvpress's own tokenization of the text"),
            "seconds": pr.get("seconds"), "kl_seconds": pr.get("kl_seconds"),
            "reference_seconds": pr.get("reference_seconds"), "load_seconds": pr.get("load_seconds"),
            "skipped": pr.get("skipped"), "kl_note": pr.get("kl_note"), "commit": commit,
            "versions": pr.get("versions")})
    return rows


def summarize(rows: list[dict], log=print) -> None:
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["split"], r["config"], r["budget"]), []).append(r)
    for (m, s, cfg, b), rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        kls = [r["kl_mean"] for r in rs if r["kl_mean"] is not None]
        log(f"variants_peers {m} {s} {cfg} b={b:g}: correct {sum(bool(r['correct']) for r in rs)}/{len(rs)}, "
            f"mean KL {sum(kls) / len(kls):.4f} ({len(kls)} prompts)" if kls else
            f"variants_peers {m} {s} {cfg} b={b:g}: no KL ({rs[0]['skipped'] or rs[0]['kl_note']})")


def row_key(r: dict) -> tuple:
    """One prompt's row of one press: a rerun replaces exactly the rows it produced again
    (a run at some lengths or depths keeps the others)."""
    return r["model"], r["split"], r["length"], r["depth"], r["config"], r["budget"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="lengths 1024 only")
    ap.add_argument("--split", choices=[*variants.SPLITS, "both"], default="both")
    ap.add_argument("--lengths", nargs="+", type=int, default=None, help=f"default {LENGTHS}")
    ap.add_argument("--depths", nargs="+", type=int, default=None, help="default: the split's own")
    ap.add_argument("--models", nargs="+", choices=evidence.MODELS, default=["smollm2-135m"])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="peers.py systems, comma-separated")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.2])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(HERE / "results" / "variants_peers.json"))
    args = ap.parse_args(argv)
    if not evidence.PEERS_VENV.exists():
        print(f"no peers environment ({evidence.PEERS_VENV}): run bash benchmarks/peers_env.sh", file=sys.stderr)
        return 2
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    os.environ["ENTROKV_BENCH_THREADS"] = str(args.threads)
    lengths = args.lengths or ([1024] if args.quick else LENGTHS)
    splits = ["tune", "heldout"] if args.split == "both" else [args.split]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in peers.ALL_SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; known: {','.join(peers.ALL_SYSTEMS)}")
    commit, t0 = evidence.commit_id(), time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    rows = []
    for model in args.models:
        cases, info = cases_for(model, splits, lengths, args.depths, args.budgets, log=log)
        new = rows_for(model, run_peers(model, cases, systems, args.threads), info, commit)
        summarize(new, log=log)
        rows += new
    settings = {"lengths": lengths, "depths": args.depths or {s: variants.SPLITS[s]["depths"] for s in splits},
                "splits": {s: variants.SPLITS[s] for s in splits}, "systems": systems, "budgets": args.budgets,
                "placement": PLACEMENT, "max_answer": MAX_NEW, "threads": args.threads,
                "kl": "kvpress's own full-cache greedy answer as reference; KL(full || press) teacher-forced along "
                      "it, nats, mean over its steps (benchmarks/peers.py)",
                "openvino": "no KL, " + peers.OpenVINOSystem.KL_NOTE,
                "model_notes": {m: TOKEN_IDS.get(m, "kvpress's own tokenization (transformers' GGUF tokenizer)")
                                for m in evidence.MODELS}}
    meta = evidence.meta("quick" if lengths == [1024] else "full", settings, time.perf_counter() - t0, commit)
    evidence.merge_rows(args.out, meta, rows, key=row_key, redo={row_key(r) for r in rows})
    log(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
