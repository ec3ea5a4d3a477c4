"""The research judges' own checks: the variants judge (benchmarks/research/variants.py) on the evidence
suite's quick run, section 7 of the report, and the reference comparison across builds."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def variants(quick):
    out = quick / "variants.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "research" / "variants.py"), "--quick", "--split", "all",
                        "--models", "smollm2-135m", "--configs", "page-entrokv", "entrokv-edge", "edge:P8",
                        "oracle:P1+max", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--results", str(quick),
                        "--report", str(quick / "REPORT.md")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_variants_keep_the_budget_and_are_graded_against_the_full_cache(variants, quick):
    rows = variants["data"]["rows"]
    cases = {(r["split"], r["length"], r["depth"]) for r in rows}
    assert {c[0] for c in cases} == {"tune", "heldout", "heldout2", "heldout3", "heldout4", "heldout5", "heldout6",
                                     "heldout7"}
    assert len(cases) == 3 + 3 + 3 + 5 + 5 + 5 + 5 + 5

    def budget_tokens(n, P):     # 20%, whole pages, the (partial) last page always among them
        return (int(0.2 * n) // P - 1) * P + n - (-(-n // P) - 1) * P

    for c in cases:
        by = {r["config"]: r for r in rows if (r["split"], r["length"], r["depth"]) == c}
        assert set(by) == {"full", "page-entrokv", "entrokv-edge", "edge:P8", "oracle:P1+max"}
        assert by["full"]["kl_mean"] == 0.0 and by["full"]["answer"].strip()
        n = by["full"]["kept_tokens"]
        for name in ("page-entrokv", "entrokv-edge", "edge:P8", "oracle:P1+max"):
            assert by[name]["kept_tokens"] == budget_tokens(n, by[name]["page_size"]) < n, name
        assert all(r["policy_uor"] == 1.0 and r["kl_mean"] >= 0.0 and 0.0 <= r["agreement"] <= 1.0
                   for r in by.values())
    assert any(r["correct"] for r in rows if r["config"] == "full" and r["split"] == "tune")
    # scored with the answer's own attention, the same budget loses far less than with the window's
    kl = lambda c: np.mean([r["kl_mean"] for r in rows if r["config"] == c])  # noqa: E731
    assert kl("oracle:P1+max") < 0.5 * kl("page-entrokv")
    text = (quick / "REPORT.md").read_text()
    assert "## 7. Beyond the paper: entrokv-edge" in text and "**heldout split**" in text
    assert "**heldout2 split**" in text and "pass-key needles" in text
    assert "**heldout3 split**" in text and "meeting-room needles" in text
    assert "**heldout4 split**" in text and "flight-gate needles" in text
    assert "**heldout5 split**" in text and "locker-code needles" in text
    assert "**heldout6 split**" in text and "drawer needles" in text
    assert "**heldout7 split**" in text and "safe-combination needles" in text
    assert "vs page-entrokv: answers" in text and "Issue 7's goal" in text
    # the goal over every split at once: one line per model and length, every prompt of the run in it
    assert "Issue 7's goal over every split at once" in text
    pooled = [ln for ln in text.splitlines() if ln.startswith("| smollm2-135m 1k |")]
    assert len(pooled) == 1 and f"| {len(cases)} |" in pooled[0]


def test_a_held_out_model_is_judged_apart_by_the_rule_fixed_before_its_run():
    """Section 7: a model no round was tuned on (Qwen2.5) gets its own table and the rule's
    verdict from its rows alone (the full cache's right answers kept, paired KL against
    Page-EntroKV), and its rows stay out of the tuning rounds' pairings. Synthetic rows: a
    verdict from the wrong rows, or the wrong way round, shows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    m = "qwen2.5-coder-0.5b"

    def rows(edge_kl, edge_right):
        out = []
        for depth in (10, 50, 90):
            base = {"model": m, "split": "heldout7", "length": 2048, "depth": depth, "policy_uor": 1.0,
                    "kept_tokens": 400}
            out += [{**base, "config": "full", "correct": True, "kl_mean": 0.0},
                    {**base, "config": "page-entrokv", "correct": True, "kl_mean": 0.05},
                    {**base, "config": "entrokv-edge", "correct": edge_right, "kl_mean": edge_kl}]
        return out
    good = report.held_out_models(rows(0.01, True))
    assert "Held out: qwen2.5-coder-0.5b on the heldout7 split" in good
    assert "| entrokv-edge | 3/3 · 0.010 | 3/3 · 0.010 |" in good
    assert "3 vs 3 kept, 3-0" in good and "it **holds**" in good
    assert "does **not** hold" in report.held_out_models(rows(0.01, False))      # answers lost
    assert "does **not** hold" in report.held_out_models(rows(0.09, True))       # KL higher
    doc = {"meta": {"settings": {"budget": 0.2, "split_order": ["heldout7"]}}, "data": {"rows": rows(0.01, True)}}
    text = report.variants_section(doc)
    assert "it **holds**" in text and "Commits of the rows: ." in text           # no tuning split holds its rows


def test_references_compare_names_the_prompts_whose_reference_or_prompt_differs():
    sys.path.insert(0, str(ROOT / "benchmarks" / "research"))
    import references

    def row(source, prompt_sha="p", ref_sha="r", n=10):
        return {"model": "m", "split": "s", "source": source, "prompt_sha": prompt_sha, "ref_sha": ref_sha,
                "ref_tokens": n}

    a = {"rows": [row("same"), row("other-ref", ref_sha="r1", n=25), row("other-prompt"), row("only-a")]}
    b = {"rows": [row("same"), row("other-ref", ref_sha="r2", n=28), row("other-prompt", prompt_sha="q")]}
    assert references.compare(a, b) == ["m s other-ref: reference 25 tokens against 28, other tokens",
                                        "m s other-prompt: other prompt tokens"]
