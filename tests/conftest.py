import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

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
