"""EntroKV Edge: Page-EntroKV KV-cache eviction inside llama.cpp, driven from Python.

Importing this package makes ``llama_cpp`` load our patched libllama; import it
before ``llama_cpp``::

    import entrokv_edge
    from llama_cpp import Llama
    llm = Llama("model.gguf", n_ctx=2048)
    entrokv_edge.geometry(llm)
"""
from ._loader import LibraryMismatchError, ensure_llama_cpp

llama_cpp = ensure_llama_cpp()

from . import models  # noqa: E402
from .bindings import (  # noqa: E402
    EntroKVError,
    KVGeometry,
    KVLayer,
    compact,
    geometry,
    n_refused,
    swa_trim,
    true_positions,
    value_norms,
)

from .bindings.observe import Observation, WindowScores  # noqa: E402
from .controller import METHOD_POLICIES, POLICIES, EvictionConfig, Policy, policy_for  # noqa: E402
from .runtime import (EntroKVLlama, EntroKVState, EvictionController, EvictionResult, PageEntroKV,  # noqa: E402
                      RecallConfig, SessionError)

__version__ = "0.1.0"

__all__ = [
    "METHOD_POLICIES",
    "POLICIES",
    "EntroKVError",
    "EntroKVLlama",
    "EntroKVState",
    "EvictionConfig",
    "EvictionResult",
    "Observation",
    "EvictionController",
    "PageEntroKV",
    "Policy",
    "RecallConfig",
    "SessionError",
    "WindowScores",
    "KVGeometry",
    "KVLayer",
    "LibraryMismatchError",
    "compact",
    "geometry",
    "llama_cpp",
    "models",
    "n_refused",
    "policy_for",
    "swa_trim",
    "true_positions",
    "value_norms",
]
