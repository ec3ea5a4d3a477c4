"""The evidence: every benchmark of the report in one run, then benchmarks/REPORT.md.

    python benchmarks/evidence.py            # full mode (under 2 hours on 2 cores)
    python benchmarks/evidence.py --quick    # every table, small sizes (under 5 minutes)
        [--out benchmarks/results] [--report benchmarks/REPORT.md] [--parts uor,masquerade,...]

Parts: uor (head-independent union overhead), masquerade (sink masquerade), niah (needle
retrieval), fidelity (KL and agreement against the full cache), speed (time and memory),
peers (OpenVINO GenAI and kvpress on the needle prompts; needs the optional environment
of benchmarks/peers_env.sh, and is reported as skipped without it). Each part writes
<out>/<part>.json with the model hashes, the commit, the machine and the settings; the
report is then generated from those files alone (python benchmarks/report.py). Threads:
every system gets --threads (default: the machine's cores): llama.cpp's n_threads and
n_threads_batch (through ENTROKV_BENCH_THREADS), OpenVINO's INFERENCE_NUM_THREADS and
torch.set_num_threads for the peers. The commit is read once, when the run starts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import entrokv_edge as ek  # noqa: E402

import _harness as H  # noqa: E402
import fidelity  # noqa: E402
import masquerade  # noqa: E402
import niah  # noqa: E402
import report  # noqa: E402
import speed  # noqa: E402
import uor_replay  # noqa: E402

PARTS = ("speed", "uor", "masquerade", "niah", "fidelity", "peers")   # speed first: its runs are fresh processes
MODELS = H.MODELS
SPEED_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")   # Gemma 3's sliding-window cache is never evicted: not timed
PEERS_VENV = HERE.parent / ".venv-peers" / "bin" / "python"


def commit_id() -> str:
    """The checkout's short commit, '+dirty' when tracked files differ from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, cwd=HERE).stdout.strip())
    except OSError:
        return "unknown"
    return (commit or "unknown") + ("+dirty" if dirty else "")


def merge_rows(out: Path, meta: dict, rows: list[dict], key, redo: set) -> None:
    """Write ``{"meta", "data": {"rows"}}`` to ``out``: the new rows plus the rows already there
    whose key(row) is not in ``redo`` (each row carries its own commit)."""
    out = Path(out)
    old = json.loads(out.read_text())["data"]["rows"] if out.exists() else []
    keep = [r for r in old if key(r) not in redo]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "data": {"rows": keep + rows}}, indent=1))


def _rows_of(data):
    """The row list inside a part's data (a list, or a dict with "rows")."""
    return data["rows"] if isinstance(data, dict) else data


def _peers_cases(data) -> dict:
    """{model: cases} of a peers part (files before the per-model runs hold SmolLM2's count alone)."""
    c = data.get("cases")
    return dict(c) if isinstance(c, dict) else ({"smollm2-135m": c} if c else {})


def merge_part(path: Path, part: str, data, doc_meta: dict, models) -> dict:
    """The part's document with this run's rows for ``models`` replacing the file's rows of
    those models and the other models' rows kept (a model added later runs alone: --models).
    Summaries are recomputed from the merged rows; ``meta["runs"]`` lists every run whose rows
    remain (models, mode, commit, date, seconds)."""
    run = {k: doc_meta[k] for k in ("mode", "commit", "date", "seconds")}
    run["models"] = sorted({r.get("model", "smollm2-135m") for r in _rows_of(data)} | set(models))
    run["threads"] = doc_meta.get("settings", {}).get("threads")
    old = json.loads(path.read_text()) if path.exists() else None
    if old is None or not isinstance(_rows_of(old["data"]), list):
        return {"meta": {**doc_meta, "runs": [run]}, "data": data}
    redo = set(run["models"])
    kept = [r for r in _rows_of(old["data"]) if r.get("model", "smollm2-135m") not in redo]
    runs = [x for x in old["meta"].get("runs", [{k: old["meta"][k] for k in ("mode", "commit", "date", "seconds")}
                                                 | {"models": sorted({r.get("model", "smollm2-135m")
                                                                      for r in _rows_of(old["data"])}),
                                                    "threads": old["meta"].get("settings", {}).get("threads")}])
            if set(x["models"]) - redo]
    for x in runs:
        x["models"] = sorted(set(x["models"]) - redo)
    rows = kept + _rows_of(data)
    if isinstance(data, dict):
        merged = {**old["data"], **data, "rows": rows}
        if part == "niah":
            merged["summary"] = niah.summary(rows)
        elif part == "fidelity":
            merged["summary"] = fidelity.summary(rows)
        elif part == "peers":       # per-model counts and notes: the other models' are kept
            merged.pop("gemma3", None)
            for k, mine in (("cases", _peers_cases), ("not_run", report.peers_not_run)):
                merged[k] = {**{m: v for m, v in mine(old["data"]).items() if m not in redo}, **mine(data)}
    else:
        merged = rows
    models_meta = {**old["meta"].get("models", {}), **doc_meta["models"]}
    return {"meta": {**doc_meta, "models": models_meta, "runs": runs + [run]}, "data": merged}


def meta(mode: str, settings: dict, seconds: float, commit: str) -> dict:
    reg = ek.models.registry()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"mode": mode, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC",
            time.gmtime()), "machine": {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "system": platform.platform(), "cpu_features": H.cpu_features()},
            "models": {m: {"file": reg[m]["file"], "sha256": reg[m]["sha256"]} for m in MODELS if m in reg},
            "settings": settings, "seconds": seconds}


def peer_cases(lengths, depths, budgets, llm, quick=False) -> list[dict]:
    """The needle prompts the peers get: the same haystack text and question as ours."""
    cases = []
    for length in lengths:
        for depth in depths:
            p = niah.needle_prompt(llm, length, depth)
            for b in list(budgets) + ([] if quick else [1.0]):
                for pl in H.PLACEMENTS:
                    cases.append({"id": f"{length}-{depth}-{b}-{pl}", "context": p.meta["context"],
                                  "question": niah.QUESTION, "budget": b, "placement": pl, "max_new_tokens": 24,
                                  "length": length, "depth": depth})
    return cases


PEERS_NOT_RUN = {"gemma3-270m": "not run: OpenVINO GenAI cannot read Gemma 3's Q5_0 tensors ([load_gguf] "
                                 "gguf_tensor_to_f16 failed), and transformers converts its GGUF tokenizer wrongly (a "
                                 "Unigram model instead of SentencePiece BPE), so kvpress would need our token ids, which "
                                 "only benchmarks/research/variants_peers.py gives it"}


def run_peers(models, quick: bool, threads: int, log=print) -> dict:
    """The peers (benchmarks/peers.py, in .venv-peers) on each model's needle prompts. A peer that
    cannot load a model answers every case of it with ``skipped`` and the load error."""
    if not PEERS_VENV.exists():
        return {"skipped": "no peers environment (.venv-peers): run bash benchmarks/peers_env.sh", "rows": []}
    grid = niah.QUICK if quick else niah.FULL
    lengths = grid["lengths"][:1] if quick else [n for n in grid["lengths"] if n <= 4096]
    depths = grid["depths"][:1] if quick else [25, 75]
    budgets = [0.2]
    rows, cases_per_model, not_run = [], {}, {}
    for model in models:
        if model in PEERS_NOT_RUN:
            not_run[model] = PEERS_NOT_RUN[model]
            continue
        llm = H.load(model, max(lengths) + 256)
        cases = peer_cases(lengths, depths, budgets, llm, quick)
        llm.close()
        cases_per_model[model] = len(cases)
        with tempfile.TemporaryDirectory() as tmp:
            inp, res = Path(tmp) / "cases.jsonl", Path(tmp) / "rows.jsonl"
            inp.write_text("".join(json.dumps(c) + "\n" for c in cases))
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            r = subprocess.run([str(PEERS_VENV), str(HERE / "peers.py"), "--gguf", str(ek.models.model_path(model)),
                                "--in", str(inp), "--out", str(res), "--threads", str(threads)],
                               capture_output=True, text=True, env=env)
            if r.returncode != 0 and not res.exists():
                err = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode
                not_run[model] = f"peers.py failed: {err}"
                continue
            by_id = {c["id"]: c for c in cases}
            for line in res.read_text().splitlines():
                row = json.loads(line)
                c = by_id.get(row["id"], {})
                row.update(model=model, length=c.get("length"), depth=c.get("depth"),
                           correct=None if row.get("skipped") else niah.correct(row.get("answer") or ""))
                rows.append(row)
        log(f"peers {model}: {sum(r['model'] == model for r in rows)} rows")
    if not rows and not_run:
        return {"skipped": "; ".join(f"{m}: {v}" for m, v in not_run.items()), "rows": []}
    return {"skipped": None, "rows": rows, "cases": cases_per_model, "not_run": not_run}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--report", default=str(HERE / "REPORT.md"))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {','.join(PARTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    os.environ["ENTROKV_BENCH_THREADS"] = str(args.threads)   # our llama.cpp runs, speed's subprocesses too
    mode = "quick" if args.quick else "full"
    commit = commit_id()
    t_all = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_all:7.1f} s] {msg}", flush=True)

    for part in parts:
        t0 = time.perf_counter()
        if part == "uor":
            s = dict(essays=2, code=1, tokens=1024) if args.quick else dict(essays=8, code=4, tokens=2048)
            data = uor_replay.run(args.models + list(uor_replay.SYNTHETIC), s["essays"], s["code"], s["tokens"],
                                  log=log)
        elif part == "masquerade":
            s = dict(prompts=1, tokens=1024) if args.quick else dict(prompts=4, tokens=2048)
            data = masquerade.run(args.models, s["prompts"], s["tokens"], log=log)
        elif part == "niah":
            s = niah.QUICK if args.quick else niah.FULL
            rows = niah.run(args.models, s["lengths"], s["depths"], s["budgets"], log=log)
            data = {"rows": rows, "summary": niah.summary(rows)}
        elif part == "fidelity":
            s = fidelity.QUICK if args.quick else fidelity.FULL
            rows = fidelity.run(args.models, s["length"], s["n_qa"], s["n_code"], s["budgets"], s["tokens"], log=log)
            data = {"rows": rows, "summary": fidelity.summary(rows)}
        elif part == "speed":
            s = speed.QUICK if args.quick else speed.FULL
            data = [row for m in args.models if m in SPEED_MODELS
                    for row in speed.run(m, s["lengths"], s["long"], s["long_cells"], s["long_budget"], s["repeats"],
                                         log=log)]
        else:
            s = {"threads": args.threads}
            data = run_peers(args.models, args.quick, args.threads, log=log)
        s = {**s, "threads": args.threads}
        doc = merge_part(out / f"{part}.json", part, data, meta(mode, s, time.perf_counter() - t0, commit),
                         [m for m in args.models if part != "speed" or m in SPEED_MODELS])
        if part == "niah":      # the heatmaps of every model in the file
            pngs = niah.heatmaps(doc["data"]["rows"], out / "png")
            doc["data"]["png"] = [str(Path(p).relative_to(out)) for p in pngs]
        (out / f"{part}.json").write_text(json.dumps(doc, indent=1))
        log(f"{part}: {doc['meta']['seconds']:.0f} s")
    # a run of some parts only: the header sums every part's own time instead of this run's
    whole = set(parts) >= set(PARTS)
    report.write(out, Path(args.report), total_seconds=time.perf_counter() - t_all if whole else None)
    log(f"report written to {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
