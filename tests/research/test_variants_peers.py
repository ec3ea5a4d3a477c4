"""benchmarks/research/variants_peers.py end to end on one short prompt: kvpress's presses get a KL
against kvpress's own full-cache answer, and a press that keeps everything (budget 1.0,
compression_ratio 0) has none, which is what shows the teacher forcing lines up with the
reference. Needs the peers' environment (benchmarks/peers_env.sh); CI has none."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-peers" / "bin" / "python"
SYSTEMS = ["kvpress-snapkv", "kvpress-streaming"]

pytestmark = pytest.mark.skipif(not VENV.exists(), reason="no peers environment (.venv-peers): "
                                "bash benchmarks/peers_env.sh makes it (CI has none)")


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2):
    out = tmp_path_factory.mktemp("variants_peers") / "variants_peers.json"
    # an earlier file: the rerun prompts' rows are replaced; rows of another press, or of the
    # same press at another length or depth (not rerun), are kept
    old = {"model": "smollm2-135m", "split": "tune", "length": 1024, "depth": 50, "budget": 0.2, "kl_mean": 9.0}
    out.write_text(json.dumps({"meta": {}, "data": {"rows": [
        dict(old, config="kvpress-expected"), dict(old, config="kvpress-snapkv"),
        dict(old, config="kvpress-snapkv", length=2048), dict(old, config="kvpress-snapkv", depth=20)]}}))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "research" / "variants_peers.py"), "--split", "tune",
                        "--lengths", "1024", "--depths", "50", "--systems", ",".join(SYSTEMS),
                        "--budgets", "0.2", "1.0", "--threads", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    return json.loads(out.read_text())


def rows_of(doc, budget):
    return {r["config"]: r for r in doc["data"]["rows"] if r["budget"] == budget and r.get("kl_steps") is not None}


def test_each_press_has_a_kl_against_the_full_cache(run):
    rows = rows_of(run, 0.2)
    assert set(rows) == set(SYSTEMS)
    for name, r in rows.items():
        assert r["skipped"] is None, (name, r["skipped"])
        assert r["model"] == "smollm2-135m" and r["split"] == "tune" and (r["length"], r["depth"]) == (1024, 50)
        assert math.isfinite(r["kl_mean"]) and r["kl_mean"] >= 0.0, (name, r["kl_mean"])
        assert len(r["kl_per_step"]) == r["kl_steps"] >= 1
        assert r["kl_mean"] == pytest.approx(sum(r["kl_per_step"]) / r["kl_steps"])
        assert 0.0 <= r["agreement"] <= 1.0
        assert isinstance(r["correct"], bool) and isinstance(r["answer"], str)
        # the press kept a fifth of kvpress's context (the template tail and the answer come after it)
        assert 0 < r["kept_tokens"] <= 0.21 * r["prompt_tokens"], (name, r["kept_tokens"], r["prompt_tokens"])


def test_the_full_reference_is_computed_once_and_is_not_empty(run):
    rows = [r for r in run["data"]["rows"] if r.get("kl_steps") is not None]
    assert len(rows) == 2 * len(SYSTEMS)
    assert {r["reference_answer"] for r in rows} == {rows[0]["reference_answer"]}
    assert {r["reference_seconds"] for r in rows} == {rows[0]["reference_seconds"]}   # one computation, shared
    assert rows[0]["reference_answer"].strip()
    assert rows[0]["kl_steps"] >= 1 and all(r["kl_steps"] == rows[0]["kl_steps"] for r in rows)


def test_a_press_that_keeps_everything_has_no_kl(run):
    # compression_ratio 0: the same cache as the full one, so the teacher-forced distributions must be the
    # reference's own (to round-off), and its answer is the reference
    rows = rows_of(run, 1.0)
    assert set(rows) == set(SYSTEMS)
    for name, r in rows.items():
        assert r["press_params"]["compression_ratio"] == 0.0
        assert r["kl_mean"] < 1e-6 and max(r["kl_per_step"]) < 1e-6, (name, r["kl_per_step"])
        assert r["kept_tokens"] > rows_of(run, 0.2)[name]["kept_tokens"]
        # kvpress stops at the model's EOS only, the reference at end-of-turn tokens too
        assert r["answer"].strip().startswith(r["reference_answer"].strip())


def test_rows_merge_and_carry_their_provenance(run):
    rows = run["data"]["rows"]
    kept = [r for r in rows if r["kl_mean"] == 9.0]
    assert [(r["config"], r["length"], r["depth"]) for r in kept] == [    # not rerun: kept
        ("kvpress-expected", 1024, 50), ("kvpress-snapkv", 2048, 50), ("kvpress-snapkv", 1024, 20)]
    assert all(r["commit"] for r in rows if r not in kept)
    m = run["meta"]
    assert m["commit"] and m["settings"]["systems"] == SYSTEMS and m["settings"]["placement"] == "inside"
    assert "gemma3-270m" in m["settings"]["model_notes"] and m["settings"]["openvino"].startswith("no KL")
