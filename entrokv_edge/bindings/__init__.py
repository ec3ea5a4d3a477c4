"""cffi bindings of our C API (native/include/llama-entrokv.h)."""
from .native import (
    EntroKVError,
    KVGeometry,
    KVLayer,
    compact,
    context_pointer,
    evict_native,
    geometry,
    n_refused,
    select_pages_native,
    true_positions,
)

__all__ = [
    "EntroKVError",
    "KVGeometry",
    "KVLayer",
    "compact",
    "context_pointer",
    "evict_native",
    "geometry",
    "n_refused",
    "select_pages_native",
    "true_positions",
]
