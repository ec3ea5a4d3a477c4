"""cffi bindings of our C API (native/include/llama-entrokv.h): the cache (native.py), the rows of its
cells (rows.py), the numeric kernels (kernels.py) and the observation hooks (observe.py)."""
from .kernels import digest_update, evict_native, recall_plan, recall_rank, select_pages_native, softmax_rows
from .native import (
    EntroKVError,
    KVGeometry,
    KVLayer,
    c_api,
    compact,
    context_pointer,
    geometry,
    n_refused,
    restore,
    set_last_logits,
    swa_trim,
    true_positions,
    used_cells,
    value_norms,
)
from .rows import read_cells, rows_to_float, swap_cells, write_cells

__all__ = [
    "EntroKVError",
    "KVGeometry",
    "KVLayer",
    "c_api",
    "compact",
    "context_pointer",
    "digest_update",
    "evict_native",
    "geometry",
    "n_refused",
    "read_cells",
    "recall_plan",
    "recall_rank",
    "softmax_rows",
    "restore",
    "rows_to_float",
    "select_pages_native",
    "set_last_logits",
    "swa_trim",
    "swap_cells",
    "true_positions",
    "used_cells",
    "value_norms",
    "write_cells",
]
