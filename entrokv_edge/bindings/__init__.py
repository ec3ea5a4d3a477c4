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
    restore,
    select_pages_native,
    set_last_logits,
    true_positions,
    used_cells,
    value_norms,
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
    "restore",
    "select_pages_native",
    "set_last_logits",
    "true_positions",
    "used_cells",
    "value_norms",
]
