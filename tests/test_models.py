"""The model registry: names resolve to verified files fetched from PyPI wheels."""
import hashlib

import pytest

from entrokv_edge.models import ModelError, main, model_path, registry


def test_registry_entries_are_complete():
    reg = registry()
    assert {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"} <= set(reg)
    for e in reg.values():
        assert len(e["sha256"]) == 64 and e["file"].endswith(".gguf") and e["wheels"]
        assert all("==" in w["requirement"] for w in e["wheels"])


def test_unknown_names_and_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        model_path("nope")
    with pytest.raises(ModelError, match="not found"):
        model_path(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("fixture, name", [("smollm2", "smollm2-135m"), ("qwen25", "qwen2.5-coder-0.5b")])
def test_fetched_model_matches_its_hash_and_is_listed(request, fixture, name, capsys):
    """One wheel (SmolLM2) or six chunk wheels joined in order (Qwen2.5)."""
    path = request.getfixturevalue(fixture)
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    assert h == registry()[name]["sha256"]
    assert main(["path", name]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert main(["list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[0] == name)
    assert line.split()[1] == "fetched" and registry()[name]["description"] in line
