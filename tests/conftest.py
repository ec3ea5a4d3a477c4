import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
ROOT = Path(__file__).resolve().parent.parent

import entrokv_edge  # noqa: E402,F401  (binds llama_cpp to the patched library first)
from synth import write_model  # noqa: E402


@pytest.fixture(scope="session")
def synth_models(tmp_path_factory):
    """Synthetic models by name: llama-r1/r2/r3/r6 and qwen2-r2/r3 (6 query heads)."""
    d = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("llama", "qwen2"):
        for r in (1, 2, 3, 6) if arch == "llama" else (2, 3):
            out[f"{arch}-r{r}"] = write_model(d / f"{arch}-r{r}.gguf", arch=arch, n_head=6,
                                              n_head_kv=6 // r, n_layer=2, seed=r)
    return out


@pytest.fixture(scope="session")
def smollm2():
    from entrokv_edge.models import model_path
    return model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    from entrokv_edge.models import model_path
    return model_path("gemma3-270m")


@pytest.fixture(scope="session")
def qwen25():
    from entrokv_edge.models import model_path
    return model_path("qwen2.5-coder-0.5b")


def pytest_collection_modifyitems(config, items):
    """Every test under tests/research/ is marked ``research`` (the judges behind the defaults): ``pytest -q`` runs
    them with the rest, ``-m "not research"`` leaves them out."""
    research = Path(__file__).resolve().parent / "research"
    for item in items:
        if research in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.research)


@pytest.fixture(scope="session")
def quick(tmp_path_factory, smollm2, gemma3):
    """The evidence suite's quick mode on SmolLM2 and Gemma 3, once per run (the evidence tests and the research
    judges read it)."""
    out = tmp_path_factory.mktemp("evidence")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "evidence.py"), "--quick", "--out", str(out),
                        "--report", str(out / "REPORT.md"), "--models", "smollm2-135m", "gemma3-270m"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out
