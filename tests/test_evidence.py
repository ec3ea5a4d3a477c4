"""The evidence benchmarks' quick mode, end to end: every part runs on the real models,
writes its results with their provenance, and the report has every table.

(Peers run only where benchmarks/peers_env.sh made .venv-peers; otherwise the report must
say they were skipped and why.)
"""
import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).parent.parent
PARTS = ["uor", "masquerade", "niah", "fidelity", "speed", "peers"]


def test_a_model_run_alone_joins_the_other_models_rows(quick, qwen25, tmp_path):
    """A model added later (--models qwen2.5-coder-0.5b) runs alone: its rows join the file's, the
    other models' rows stay as they were, and the report lists both runs."""
    import shutil
    out = tmp_path / "results"
    shutil.copytree(quick, out)
    before = json.loads((out / "masquerade.json").read_text())
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "evidence.py"), "--quick", "--out", str(out),
                        "--report", str(out / "REPORT.md"), "--models", "qwen2.5-coder-0.5b", "--parts", "masquerade"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    after = json.loads((out / "masquerade.json").read_text())
    assert after["data"][:2] == before["data"] and after["data"][2]["model"] == "qwen2.5-coder-0.5b"
    assert after["data"][2]["r"] == 7
    runs = after["meta"]["runs"]
    assert [x["models"] for x in runs] == [["gemma3-270m", "smollm2-135m"], ["qwen2.5-coder-0.5b"]]
    assert set(after["meta"]["models"]) >= {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"}
    text = (out / "REPORT.md").read_text()
    assert "| qwen2.5-coder-0.5b | 7 |" in text
    assert "gemma3-270m, smollm2-135m + quick mode" in text           # the parts line names both runs


def test_every_part_writes_its_results_with_provenance(quick):
    for part in PARTS:
        doc = json.loads((quick / f"{part}.json").read_text())
        m = doc["meta"]
        assert m["mode"] == "quick" and m["commit"] and m["machine"]["cores"] >= 1
        assert m["machine"]["cpu_features"]         # what the loaded ggml was built with (its kernels' rounding)
        assert all(len(v["sha256"]) == 64 for v in m["models"].values())
        assert m["seconds"] > 0


def test_report_has_every_table(quick):
    text = (quick / "REPORT.md").read_text()
    for title in ("## 1. Head-independent union overhead", "## 2. Sink masquerade", "## 3. Needle in a haystack",
                  "## 4. Fidelity to the full cache", "## 5. Speed and memory", "## 6. Peers"):
        assert title in text
    assert "Not run in this report" not in text
    peers = json.loads((quick / "peers.json").read_text())["data"]
    if peers["skipped"]:
        assert "Skipped: no peers environment" in text
    else:
        assert any(r["system"].startswith("kvpress") for r in peers["rows"])


def test_uor_page_entrokv_is_exactly_one_and_head_independent_is_counted(quick):
    rows = json.loads((quick / "uor.json").read_text())["data"]
    assert {r["model"] for r in rows} == {"smollm2-135m", "gemma3-270m", "synthetic-r6", "synthetic-r8"}
    assert {r["model"]: r["r"] for r in rows if r["model"].startswith("synthetic")} == \
        {"synthetic-r6": 6, "synthetic-r8": 8}
    assert all(r["uor_max"] <= r["r"] for r in rows)         # a union holds at most r sets
    assert all(r["page_entrokv_uor"] == 1.0 for r in rows)
    assert all(r["measurements"] > 0 and r["uor_max"] >= r["uor_mean"] >= 1.0 for r in rows)
    assert max(r["uor_max"] for r in rows) > 1.0          # head-independent does overflow somewhere
    assert "Page-EntroKV UOR is 1.000 in every cell" in (quick / "REPORT.md").read_text()


def test_needle_full_cache_answers_and_every_policy_ran(quick):
    d = json.loads((quick / "niah.json").read_text())["data"]
    full = [r for r in d["rows"] if r["policy"] == "full"]
    assert full and all(r["correct"] for r in full if r["model"] == "smollm2-135m")
    pols = {r["policy"] for r in d["rows"]}
    assert pols == {"full", "page-entrokv", "mean-pool", "max-pool", "head-independent", "no-isolation", "streaming"}
    for r in d["rows"]:
        if r["policy"] not in ("full", "head-independent"):
            assert r["policy_uor"] == 1.0      # the exact budget holds in every run
    assert all((quick / p).exists() for p in d["png"])


def test_fidelity_and_speed_measured(quick):
    f = json.loads((quick / "fidelity.json").read_text())["data"]["rows"]
    assert {r["kind"] for r in f} == {"qa", "code"}
    assert all(r["kl_mean"] >= 0 and 0 <= r["agreement"] <= 1 for r in f)
    # the method's evicting policies and the default policy, each on every prompt and placement
    pols = ("page-entrokv", "mean-pool", "max-pool", "head-independent", "no-isolation", "streaming", "entrokv-edge")
    assert {r["policy"] for r in f} == set(pols)
    cases = {(r["model"], r["source"], r["placement"]) for r in f}
    assert len(f) == len(cases) * len(pols)
    for r in f:
        if r["policy"] != "head-independent":     # the exact budget: 20% in whole pages, never the whole prompt
            assert 0.15 * r["prompt_tokens"] <= r["kept_tokens"] <= 0.21 * r["prompt_tokens"], r
    text = (quick / "REPORT.md").read_text()
    assert "**entrokv-edge (its defaults) on the same prompts:**" in text
    assert "Issue 7's goal on this judge" in text
    s = json.loads((quick / "speed.json").read_text())["data"]
    long = {r["mode"]: r for r in s if r["part"] == "long"}
    assert set(long) == {"plain", "page-entrokv", "entrokv-edge"}     # the method and the default policy
    for pol in ("page-entrokv", "entrokv-edge"):
        assert long[pol]["evictions"] >= 1 and long[pol]["eviction_s"] > 0
        assert long[pol]["kv_bytes_allocated"] < long["plain"]["kv_bytes_allocated"]


def test_eviction_cost_times_every_setting_on_the_same_prompt(tmp_path):
    out = tmp_path / "cost.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eviction_cost.py"), "--models", "smollm2-135m",
                        "--lengths", "1024", "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("smollm2-135m")]
    assert len(lines) == 1
    n, *secs = lines[0].split()[1:]
    assert 1000 <= int(n) <= 1024 and len(secs) == 6 and all(float(x) > 0 for x in secs[:5])
    assert 1 <= int(secs[5]) <= 24          # the default's draft decoded tokens (the answer is not empty)
    rows = {x["setting"]: x for x in json.loads(out.read_text())["data"]["rows"]}
    assert len(rows) == 4 and all(x["r"] == 3 and x["tokens"] == int(n) for x in rows.values())
    for x in rows.values():                 # the parts add up to the whole eviction (within timer overhead)
        parts = x["draft_s"] + x["select_s"] + x["compact_s"] + x["metrics_s"]
        assert 0 < parts <= x["total_s"] * 1.001 + 1e-4 and x["select_s"] > 0 and x["compact_s"] > 0
    assert rows["page-entrokv"]["draft_s"] < 1e-3 < rows["entrokv-edge (lookahead=24)"]["draft_s"]


def _fidelity_rows(kl: dict, kept: dict) -> list[dict]:
    return [{"model": "m", "kind": "qa", "source": src, "placement": "inside", "budget": 0.2, "policy": pol,
             "kl_mean": kl[pol] + i * 0.01, "kept_tokens": kept.get(pol, 100)}
            for i, src in enumerate(("a.txt", "b.txt")) for pol in kl]


def test_fidelity_goal_line_names_every_policy_at_or_below_the_default():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    kl = {"entrokv-edge": 0.10, "page-entrokv": 0.30, "mean-pool": 0.20, "max-pool": 0.25, "head-independent": 0.15,
          "no-isolation": 0.30, "streaming": 0.40}
    text = report.fidelity_edge(_fidelity_rows(kl, {}))
    assert "| m | inside | 20% | 2 | 0.105 | 0.305 (2-0) |" in text
    assert "m, question inside: lower than every other policy" in text
    kl["head-independent"], kl["streaming"] = 0.05, 0.10          # lower, and equal: neither is beaten
    text = report.fidelity_edge(_fidelity_rows(kl, {"head-independent": 200}))
    assert "not lower than head-independent (0.055, 2.00x the tokens), streaming (0.105, 1.00x the tokens)" in text
    assert "0.055 (0-2)" in text and "0.105 (0-0)" in text
    assert report.fidelity_edge([r for r in _fidelity_rows(kl, {}) if r["policy"] != "entrokv-edge"]) == ""


def test_fidelity_refuses_a_budget_outside_the_unit_interval():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fidelity.py"), "--budgets", "0.2", "1.5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "budgets must be fractions in (0, 1], got [0.2, 1.5]" in r.stderr


def test_report_sections_8_and_9_render_their_rows():
    """Section 8's fidelity table pairs guided with piecewise per prompt and names a model that could
    not run through the small cache with its reason; section 9 carries the soak's oracle counts and
    every fuzz part. Synthetic rows, so a wrong pairing or a dropped row shows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    rows = []
    for i, (pw, gd) in enumerate([(0.3, 0.1), (0.2, 0.25), (0.4, 0.2)]):
        base = {"part": "fidelity", "split": "fidelity", "model": "m", "kind": "qa", "source": f"s{i}", "cells": 512,
                "commit": "c"}
        rows += [{**base, "config": "one eviction", "kl_mean": 0.1, "kept_tokens": 384},
                 {**base, "config": "piecewise", "kl_mean": pw}, {**base, "config": "guided", "kl_mean": gd}]
    rows.append({"part": "fidelity", "split": "fidelity", "model": "g", "config": "not run", "cells": 512,
                 "reason": "a cache of 512 cells cannot run it", "commit": "c"})
    for i, (gd, d0, d24) in enumerate([(0.2, 0.3, 0.1), (0.4, 0.5, 0.9)]):     # tune prompts: not the judge's table
        base = {"part": "fidelity", "split": "fidelity-tune", "model": "m", "kind": "qa", "source": f"t{i}",
                "cells": 512, "commit": "t"}
        rows += [{**base, "config": "one eviction", "kl_mean": 0.05}, {**base, "config": "guided", "kl_mean": gd},
                 {**base, "config": "guide-nodraft", "kl_mean": d0}, {**base, "config": "guide+draft24", "kl_mean": d24}]
    s = report.long_prompt_section({"meta": {}, "data": {"rows": rows}})
    line = next(l for l in s.splitlines() if l.startswith("| m | 3 |"))
    assert "| 3 | 512 | 384 |" in line and "0.183" in line and "1.83x" in line and "2-1" in line
    assert "g: not run (a cache of 512 cells cannot run it)" in s
    tune = next(l for l in s.splitlines() if l.startswith("| m | 2 |"))
    assert tune == "| m | 2 | 0.050 | 0.300 | 0.400 (0-2) | 0.500 (1-1) |", tune
    soak = json.loads((ROOT / "benchmarks" / "results" / "soak.json").read_text())
    fuzz = {"examples": 5, "derandomize": True, "parts": {"compact": {"inputs": 5, "accepted": 2, "seconds": 0.1,
                                                                       "outcomes": {"ok": 2, "LIST_LENGTH": 3}}}}
    s = report.robustness_section(soak, fuzz)
    assert f"state equal in {soak['blob_equal']} of {soak['checked']}" in s
    assert "| compact | 5 | 2 | 3 | ok 2, LIST_LENGTH 3 |" in s


def test_the_chat_sections_pair_each_question_and_each_prompt():
    """Sections 10-12 from synthetic rows: later turns counted among the full cache's right answers and paired
    with final evictions per question; KV types paired with q4_0 per prompt; the server's ratios from its
    summary. A wrong key or a dropped row changes a count."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report_chat
    meta = {"commit": "c", "date": "d", "settings": {"threads": 2}}
    rows = []
    for q, (full, ev, tu) in enumerate([(True, False, True), (True, False, False), (False, False, True)]):
        base = {"split": "heldout", "model": "m", "doc": q // 2, "kind": f"k{q}"}
        rows += [{**base, "config": "full", "right": full, "ttft_s": 0.2},
                 {**base, "config": "evicted", "right": ev, "ttft_s": 0.1},
                 {**base, "config": "turns", "right": tu, "ttft_s": 0.3 + q}]
    s = report_chat.later_turns_section({"meta": meta, "data": {"rows": rows}})
    line = next(l for l in s.splitlines() if l.startswith("| m | turns |"))
    assert "| 2 | 2 of 3 | 1 of 2 | 1.300 | 6.50x | 2/0/1" in line, line
    assert "1 of the full cache's 2 right answers (50%)" in s
    kv = []
    for i, (f16, q4, ev) in enumerate([(True, False, True), (True, True, False), (True, False, True)]):
        base = {"part": "answers", "model": "m", "length": 4096, "prompt": i}
        kv += [{**base, "config": "f16", "right": f16, "kl_mean": 0.0, "kv_share": 1.0},
               {**base, "config": "q4_0", "right": q4, "kl_mean": 0.3, "kv_share": 0.28},
               {**base, "config": "f16@25", "right": ev, "kl_mean": 0.1, "kv_share": 0.25}]
    s = report_chat.kv_types_section({"meta": meta, "data": {"rows": kv}})
    line = next(l for l in s.splitlines() if "| f16@25 |" in l)
    assert "| 25.0% | 2 of 3 | 2 of 3 | 0.100 | 2/1/0" in line, line
    summary = {"requests": 10, "answered": 9, "refused_503": 0, "failed": 0, "dropped_on_purpose": 1, "wall_s": 60.0,
               "turns_same": 9, "turns_differ": 0, "tokens_per_s_p50": 3.0, "rss_mib_start": 100.0,
               "rss_mib_max": 120.0, "rss_slope_mib_per_min": 0.1, "rss_slope_noise_mib": 2.0}
    for name, p50, p95 in (("first", 2.0, 3.0), ("followup", 0.5, 2.0)):
        summary.update({f"ttft_{name}_client_p50_s": p50, f"ttft_{name}_client_p95_s": p95,
                        f"ttft_{name}_server_p50_s": p50 / 2, f"ttft_{name}_server_p95_s": p95 / 2})
    s = report_chat.serve_section({"meta": {**meta, "settings": {"clients": 4, "model": "m", "kv_cells": 512,
                                                                 "threads": 2}}, "data": {"summary": summary}})
    assert "| followup | 0.50 | 2.00 | 4.00 | 0.25 | 1.00 |" in s and "| 10 | 9 | 0 | 0 | 1 | 60 | 9 | 0 |" in s


def test_the_long_prompt_report_pairs_kl_only_within_one_build():
    """Rows of one commit made by builds of other CPU features are not paired (their full cache's reference
    answers differ); the same rows from one build are."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    def rows(features_b):
        out = []
        for i, (pw, gd) in enumerate([(0.3, 0.2), (0.5, 0.1), (0.2, 0.4)]):
            base = {"part": "fidelity", "split": "fidelity", "model": "m", "kind": "qa", "source": f"s{i}",
                    "cells": 512, "commit": "c"}
            out += [{**base, "config": "one eviction", "kl_mean": 0.1, "cpu_features": "AVX AVX2"},
                    {**base, "config": "piecewise", "kl_mean": pw, "cpu_features": features_b},
                    {**base, "config": "guided", "kl_mean": gd, "cpu_features": "AVX AVX2"}]
        return report.long_prompt_section({"meta": {}, "data": {"rows": out}})

    line = lambda s: next(ln for ln in s.splitlines() if ln.startswith("| m | 3 |"))   # noqa: E731
    assert "| 2-1 (p " in line(rows("AVX AVX2"))
    assert "2-1" not in line(rows("AVX AVX2 AVX512")) and "not in one run" in line(rows("AVX AVX2 AVX512"))


def test_peers_of_a_model_run_alone_join_the_other_models_and_the_report_pairs_each(tmp_path):
    """The peers part per model: a run on one model replaces that model's rows, counts and notes
    and keeps the others' (a file from before the per-model runs, with SmolLM2's count alone and
    Gemma 3's note under "gemma3", included); the report gives each model its own table, paired
    with that model's needle rows, and a peer's load error. Synthetic rows, so a dropped or
    mixed-up model shows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import evidence
    import report

    def row(system, model, correct, skipped=None):
        r = {"id": "1024-25-0.2-inside", "system": system, "placement": "inside", "budget": 0.2, "length": 1024,
             "depth": 25, "correct": None if skipped else correct, "skipped": skipped, "kept_tokens": 200,
             "peak_cache_tokens": 1024}
        return r if model is None else {**r, "model": model}

    path = tmp_path / "peers.json"
    old_meta = {"mode": "full", "commit": "a", "date": "d", "seconds": 1.0, "models": {}, "settings": {"threads": 2}}
    path.write_text(json.dumps({"meta": old_meta, "data": {
        "skipped": None, "cases": 24, "gemma3": "not run: Q5_0", "rows": [row("kvpress-snapkv", None, True)]}}))
    new = {"skipped": None, "cases": {"qwen2.5-coder-0.5b": 1}, "not_run": {},
           "rows": [row("kvpress-snapkv", "qwen2.5-coder-0.5b", False),
                    row("openvino", "qwen2.5-coder-0.5b", None, skipped="load failed: RuntimeError: Q5_0")]}
    doc = evidence.merge_part(path, "peers", new, {**old_meta, "commit": "b"}, ["qwen2.5-coder-0.5b"])
    data = doc["data"]
    assert data["cases"] == {"smollm2-135m": 24, "qwen2.5-coder-0.5b": 1}
    assert data["not_run"] == {"gemma3-270m": "not run: Q5_0"} and "gemma3" not in data
    assert [r.get("model", "smollm2-135m") for r in data["rows"]] == ["smollm2-135m"] + ["qwen2.5-coder-0.5b"] * 2
    niah_rows = [{"model": m, "target_length": 1024, "depth": 25, "placement": "inside", "budget": 0.2,
                  "policy": "page-entrokv", "correct": ok, "kept_tokens": 200}
                 for m, ok in (("smollm2-135m", False), ("qwen2.5-coder-0.5b", True))]
    text = report.peers_section(doc, {"data": {"rows": niah_rows}})
    smol, qwen = text.split("### smollm2-135m")[1].split("### qwen2.5-coder-0.5b")
    assert "vs kvpress-snapkv: ties (no significant difference): 0 wins, 1 losses, 0 ties" in smol
    assert "vs kvpress-snapkv: ties (no significant difference): 1 wins, 0 losses, 0 ties" in qwen and "openvino, inside: load failed: RuntimeError: Q5_0" in qwen
    assert "- gemma3-270m: not run: Q5_0." in text


def test_the_parts_line_names_each_runs_threads_where_they_differ(tmp_path):
    """A part whose rows come from runs on different thread counts says each run's count (the
    file's last settings would claim one count for every row)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    src = json.loads((ROOT / "benchmarks" / "results" / "masquerade.json").read_text())
    runs = src["meta"]["runs"]
    (tmp_path / "masquerade.json").write_text(json.dumps(src))
    report.write(tmp_path, tmp_path / "R.md")
    line = next(l for l in (tmp_path / "R.md").read_text().splitlines() if l.startswith("Parts:"))
    assert len({x["threads"] for x in runs}) == 1 and f"{runs[0]['threads']} threads for every system" in line
    runs[0]["threads"], runs[1]["threads"] = 2, 1
    (tmp_path / "masquerade.json").write_text(json.dumps(src))
    report.write(tmp_path, tmp_path / "R.md")
    line = next(l for l in (tmp_path / "R.md").read_text().splitlines() if l.startswith("Parts:"))
    assert f"`{runs[0]['commit']}`" in line and "2 thread(s) + " in line and line.endswith("1 thread(s).")


def test_a_row_log_reuses_the_full_caches_rows_from_any_commit_and_the_others_only_from_named_ones(tmp_path):
    """long_prompt.py's row log: a rerun at another commit reuses the full cache's rows, and the
    others only from its own commit or one given with --reuse-from; every row keeps its commit."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import long_prompt
    path = tmp_path / "rows.jsonl"
    first = long_prompt.RowLog(str(path), "a")
    key = {"model": "m", "depth": 15}
    first.add({**key, "config": "full", "commit": "a", "correct": True})
    first.add({**key, "config": "piecewise", "cells": 1024, "commit": "a", "correct": False})
    later = long_prompt.RowLog(str(path), "b")
    assert later.find({**key, "config": "full"})["commit"] == "a"
    assert later.find({**key, "config": "piecewise", "cells": 1024}) is None
    named = long_prompt.RowLog(str(path), "b", also=["a"])
    assert named.find({**key, "config": "piecewise", "cells": 1024})["commit"] == "a"
    assert named.find({**key, "config": "piecewise", "cells": 2048}) is None
    named.add({**key, "config": "guided", "cells": 1024, "commit": "b", "correct": True})
    assert [r["commit"] for r in long_prompt.RowLog(str(path), "c").rows] == ["a", "a", "b"]
