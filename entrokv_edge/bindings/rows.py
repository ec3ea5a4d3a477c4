"""The rows of cells: a (layer, KV head) slot's K and V slices read, written and swapped in the
cache's own types, and rows converted to floats as ggml converts them."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .native import (GGML_TYPE_IDS, GGML_TYPE_NAMES, KVGeometry, KVLayer, c_api, check, check_int32_range,
                     context_pointer, geometry)


def _row_bytes(g: KVGeometry) -> tuple[np.ndarray, np.ndarray]:
    """int64 [n_slots] each: bytes of one (slot, cell) row of K and of V (one KV head's slice). Read-only."""
    return _layer_row_bytes(g.layers)


@lru_cache(maxsize=16)
def _layer_row_bytes(layers: tuple[KVLayer, ...]) -> tuple[np.ndarray, np.ndarray]:
    k = np.concatenate([np.full(l.n_head_kv, l.k_bytes_per_cell // l.n_head_kv) for l in layers]).astype(np.int64)
    v = np.concatenate([np.full(l.n_head_kv, l.v_bytes_per_cell // l.n_head_kv) for l in layers]).astype(np.int64)
    k.flags.writeable = v.flags.writeable = False
    return k, v


def _cell_lists(cells, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(lens int32 [n_slots], the lists concatenated int32) from n_slots 1-D integer lists."""
    rows = [np.asarray(r) for r in cells]
    if len(rows) != n_slots:
        raise ValueError(f"got {len(rows)} cell lists, the cache has {n_slots} (layer, KV head) slots")
    for r in rows:
        if r.ndim != 1 or (r.size and r.dtype.kind not in "iu"):
            raise TypeError("each cell list must be a 1-D array of integer cell indices")
    lens = np.array([r.size for r in rows], dtype=np.int32)
    if not lens.sum():
        return lens, np.zeros(1, np.int32)
    flat = np.concatenate(rows)
    check_int32_range(flat)                # all lists at once (checked before the conversion to int32)
    return lens, np.ascontiguousarray(flat, np.int32)


def read_cells(llm, cells, g: KVGeometry | None = None, buffers: bool = False, keys_only: bool = False):
    """The rows of ``cells`` (n_slots lists of cell indices, one per (layer, KV head) slot):
    (k, v), each a list of n_slots uint8 arrays [len, bytes per row]: the slot's K and V
    slices of those cells, in the cache's own types (V in row form even when the cache
    stores it transposed). Reads only. ``g``: the cache's geometry, if the caller has it;
    ``buffers``: (k, v) as the two uint8 buffers the lists would be views of, slot after slot;
    ``keys_only``: V is not read (v is None)."""
    ffi, lib = c_api()
    g = g or geometry(llm)
    lens, flat = _cell_lists(cells, g.n_slots)
    kb, vb = _row_bytes(g)
    k = np.empty(int((lens * kb).sum()), np.uint8)
    v = None if keys_only else np.empty(int((lens * vb).sum()), np.uint8)
    check(lib.llama_entrokv_read_cells(context_pointer(llm), g.n_slots, ffi.from_buffer("int32_t[]", lens),
                                        ffi.from_buffer("int32_t[]", flat), ffi.from_buffer("char[]", k), k.size,
                                        ffi.NULL if keys_only else ffi.from_buffer("char[]", v), 0 if keys_only else v.size))
    if buffers:
        return k, v
    ko, vo = np.cumsum(lens * kb)[:-1], np.cumsum(lens * vb)[:-1]
    return ([a.reshape(n, r) for a, n, r in zip(np.split(k, ko), lens, kb)],
            None if keys_only else [a.reshape(n, r) for a, n, r in zip(np.split(v, vo), lens, vb)])


def write_cells(llm, cells, true_pos, k, v, g: KVGeometry | None = None) -> None:
    """Write rows into compacted cells: for slot s, cell ``cells[s][j]`` receives the K and V
    slices ``k[s][j]`` and ``v[s][j]`` (uint8 rows as ``read_cells`` gives them) and from
    now on holds true position ``true_pos[s][j]`` for that slot. ``true_pos``, ``k`` and ``v``
    may also be given flat, every slot's in turn: a 1-D integer array, and uint8 arrays of
    the rows (as ``read_cells(..., buffers=True)`` gives them). Refused (EntroKVError, the
    cache untouched) unless every cell is a compacted cell, listed once, and every slot's
    true positions stay distinct. ``g``: the cache's geometry, if the caller has it."""
    _write(llm, cells, true_pos, k, v, g, swap=False)


def swap_cells(llm, cells, true_pos, k, v, g: KVGeometry | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``write_cells``, and the rows those cells held before: (k, v), the two uint8 buffers of
    ``read_cells(llm, cells, buffers=True)`` as it would have read them just before the write,
    in one pass over the cache. The same refusals (the cache untouched)."""
    return _write(llm, cells, true_pos, k, v, g, swap=True)


def _write(llm, cells, true_pos, k, v, g: KVGeometry | None, swap: bool):
    ffi, lib = c_api()
    g = g or geometry(llm)
    lens, flat = _cell_lists(cells, g.n_slots)
    if isinstance(true_pos, np.ndarray) and true_pos.ndim == 1 and true_pos.dtype != object:
        if true_pos.size and true_pos.dtype.kind not in "iu":
            raise TypeError("true_pos must hold integer positions")
        if true_pos.size != int(lens.sum()):
            raise ValueError("true_pos must have one position per listed cell")
        check_int32_range(true_pos)
        tp = np.ascontiguousarray(true_pos, np.int32) if true_pos.size else np.zeros(1, np.int32)
    else:
        _, tp = _cell_lists(true_pos, g.n_slots)
        if [len(np.asarray(t)) for t in true_pos] != lens.tolist():
            raise ValueError("true_pos must have one position per listed cell")

    def rows(a, name):
        if isinstance(a, np.ndarray) and a.dtype == np.uint8:
            return np.ascontiguousarray(a).reshape(-1)
        if len(a) != g.n_slots:
            raise ValueError(f"{name} must hold one row array per slot ({g.n_slots}), or all rows as one uint8 array")
        return np.ascontiguousarray(np.concatenate([np.asarray(x, np.uint8).ravel() for x in a]) if len(a) else
                                    np.zeros(0, np.uint8))
    kk, vv = rows(k, "k"), rows(v, "v")
    buf = lambda a: ffi.from_buffer("char[]", a) if a.size else ffi.NULL      # noqa: E731
    args = (context_pointer(llm), g.n_slots, ffi.from_buffer("int32_t[]", lens), ffi.from_buffer("int32_t[]", flat),
            ffi.from_buffer("int32_t[]", tp), buf(kk), kk.size, buf(vv), vv.size)
    if not swap:
        check(lib.llama_entrokv_write_cells(*args))
        return None
    ko, vo = np.empty_like(kk), np.empty_like(vv)
    check(lib.llama_entrokv_swap_cells(*args, buf(ko), buf(vo)))
    return ko, vo


def rows_to_float(rows: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [n, elements]: rows (uint8 [n, bytes], as ``read_cells`` gives them) of a cache
    type (``KVGeometry.type_k`` / ``type_v``) converted to float as ggml converts them. F32 and BF16
    convert exactly, here; F16 (exactly, F16C where the CPU has it) and the quantized types in C."""
    t = GGML_TYPE_IDS[type_name] if type_name in GGML_TYPE_IDS else int(type_name)
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    n, nb = rows.shape
    if t in (0, 30) and nb % (4 if t == 0 else 2) == 0:
        if t == 0:
            return rows.view(np.float32).copy()
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return _ggml_to_float(rows, t)


def _ggml_to_float(rows: np.ndarray, t: int) -> np.ndarray:
    """rows_to_float through ggml's conversion of type id ``t``."""
    ffi, lib = c_api()
    n, nb = rows.shape
    # elements per row: bytes / (bytes per block) * (elements per block), from one probe of the type
    per = {0: (4, 1), 1: (2, 1), 30: (2, 1), 8: (34, 32), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32),
           20: (18, 32)}
    if t not in per:
        raise ValueError(f"cache type {GGML_TYPE_NAMES.get(t, t)} cannot be converted here")
    bb, be = per[t]
    if nb % bb:
        raise ValueError(f"a row of {nb} bytes is not whole blocks of {GGML_TYPE_NAMES.get(t, t)}")
    out = np.empty((n, nb // bb * be), np.float32)
    if out.size:
        check(lib.llama_entrokv_to_float(t, ffi.from_buffer("char[]", rows), ffi.from_buffer("float[]", out), out.size))
    return out
