"""cffi bindings of our C API (native/include/llama-entrokv.h)."""
from .native import (
    EntroKVError,
    KVGeometry,
    KVLayer,
    compact,
    context_pointer,
    geometry,
    n_refused,
    true_positions,
)

__all__ = [
    "EntroKVError",
    "KVGeometry",
    "KVLayer",
    "compact",
    "context_pointer",
    "geometry",
    "n_refused",
    "true_positions",
]
