"""The model registry: names resolve to verified files fetched from PyPI wheels."""
import hashlib

import pytest

from entrokv_edge.models import ModelError, main, model_path, registry


def test_registry_entries_are_complete():
    reg = registry()
    assert {"smollm2-135m", "gemma3-270m"} <= set(reg)
    for e in reg.values():
        assert len(e["sha256"]) == 64 and e["file"].endswith(".gguf") and e["wheels"]
        assert all("==" in w["requirement"] for w in e["wheels"])


def test_unknown_names_and_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        model_path("nope")
    with pytest.raises(ModelError, match="not found"):
        model_path(str(tmp_path / "missing.gguf"))


def test_fetched_model_matches_its_hash(smollm2, capsys):
    h = hashlib.sha256(smollm2.read_bytes()).hexdigest()
    assert h == registry()["smollm2-135m"]["sha256"]
    assert main(["path", "smollm2-135m"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2)
