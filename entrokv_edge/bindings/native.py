"""Typed Python wrappers over our C API, through cffi (ABI mode).

The cdef is read from the installed header ``llama-entrokv.h`` itself, so the C
header is the one place where the API is written down. The library is the same
libllama that llama_cpp loaded (dlopen returns the same handle), so a
``llama_cpp.Llama``'s context pointer can be handed to it directly.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np
from cffi import FFI

from .._paths import LIBLLAMA, include_dir, lib_dir

# ggml_type ids of the cache types we report by name
_GGML_TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16", 20: "iq4_nl"}
_GGML_TYPE_IDS = {v: k for k, v in _GGML_TYPE_NAMES.items()}


def _cdef_source(header: str) -> str:
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", header, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return ("struct llama_context;\ntypedef int32_t llama_seq_id;\ntypedef int32_t llama_pos;\n"
            + text.replace("LLAMA_API", ""))


@lru_cache(maxsize=None)
def _api():
    ffi = FFI()
    ffi.cdef(_cdef_source((include_dir() / "llama-entrokv.h").read_text()))
    lib = ffi.dlopen(str(lib_dir() / LIBLLAMA))
    return ffi, lib


class EntroKVError(RuntimeError):
    """A refusal or failure of the native API; the cache is left as it was.

    ``code`` is the negative ``llama_entrokv_status`` value, ``name`` its enum name.
    """

    def __init__(self, code: int, message: str):
        ffi, lib = _api()
        self.code = int(code)
        self.name = next(
            (n for n in dir(lib) if n.startswith("LLAMA_ENTROKV_ERR_") and getattr(lib, n) == code), "UNKNOWN"
        )
        self.message = message
        super().__init__(f"{self.name}: {message}")


def _check(rc: int) -> int:
    if rc < 0:
        ffi, lib = _api()
        raise EntroKVError(rc, ffi.string(lib.llama_entrokv_last_error()).decode("utf-8", "replace"))
    return rc


def context_pointer(obj):
    """A cffi ``struct llama_context *`` from a llama_cpp.Llama, its LlamaContext,
    a ctypes pointer or an integer address."""
    ffi, _ = _api()
    for attr in ("ctx", "_ctx"):  # Llama.ctx, then LlamaContext.ctx
        if hasattr(obj, attr) and not isinstance(obj, (int, ctypes.c_void_p)):
            inner = getattr(obj, attr)
            if inner is not None and inner is not obj:
                return context_pointer(inner)
    if isinstance(obj, int):
        addr = obj
    else:
        try:
            addr = ctypes.cast(obj, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError) as e:
            raise TypeError(f"cannot take a llama_context pointer from {type(obj).__name__}") from e
    if not addr:
        raise ValueError("the llama_context pointer is NULL (model closed?)")
    return ffi.cast("struct llama_context *", addr)


@dataclass(frozen=True)
class KVLayer:
    """One eligible KV layer: ``il`` is the model's layer id; slots
    ``slot0 .. slot0 + n_head_kv - 1`` are its (layer, KV head) pairs."""

    il: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    slot0: int
    on_host: bool
    k_bytes_per_cell: int
    v_bytes_per_cell: int


@dataclass(frozen=True)
class KVGeometry:
    """Geometry of the compactable (full-attention) KV cache of a context."""

    n_layers: int
    n_slots: int
    kv_size: int
    n_used: int
    v_trans: bool
    is_iswa: bool
    type_k: str
    type_v: str
    n_compacted: int
    n_compactions: int
    pos_max: int
    host_buffers: bool
    layers: tuple[KVLayer, ...] = field(default_factory=tuple)

    @property
    def bytes_per_cell(self) -> int:
        """K + V bytes of one cell summed over the eligible layers."""
        return sum(l.k_bytes_per_cell + l.v_bytes_per_cell for l in self.layers)

    def slot_layers(self) -> np.ndarray:
        """int32 [n_slots]: the model layer id of each slot."""
        return np.concatenate([np.full(l.n_head_kv, l.il, dtype=np.int32) for l in self.layers])

    def slot_heads(self) -> np.ndarray:
        """int32 [n_slots]: the KV head of each slot within its layer."""
        return np.concatenate([np.arange(l.n_head_kv, dtype=np.int32) for l in self.layers])


def geometry(llm) -> KVGeometry:
    """Geometry of ``llm``'s KV cache (a llama_cpp.Llama or a context pointer)."""
    ffi, lib = _api()
    ctx = context_pointer(llm)
    g = ffi.new("struct llama_entrokv_geometry *")
    _check(lib.llama_entrokv_get_geometry(ctx, g))
    layers = []
    li = ffi.new("struct llama_entrokv_layer *")
    for i in range(g.n_layers):
        _check(lib.llama_entrokv_get_layer(ctx, i, li))
        layers.append(KVLayer(li.il, li.n_head_kv, li.head_dim_k, li.head_dim_v, li.slot0,
                              bool(li.on_host), int(li.k_bytes_per_cell), int(li.v_bytes_per_cell)))
    return KVGeometry(
        n_layers=g.n_layers, n_slots=g.n_slots, kv_size=g.kv_size, n_used=g.n_used,
        v_trans=bool(g.v_trans), is_iswa=bool(g.is_iswa),
        type_k=_GGML_TYPE_NAMES.get(g.type_k, str(g.type_k)), type_v=_GGML_TYPE_NAMES.get(g.type_v, str(g.type_v)),
        n_compacted=g.n_compacted, n_compactions=g.n_compactions, pos_max=g.pos_max,
        host_buffers=bool(g.host_buffers), layers=tuple(layers),
    )


def used_cells(llm) -> int:
    """Cells of the (compactable) cache that hold a token: one native call, for hot paths."""
    ffi, lib = _api()
    g = ffi.new("struct llama_entrokv_geometry *")
    _check(lib.llama_entrokv_get_geometry(context_pointer(llm), g))
    return int(g.n_used)


def _slot_table(llm, fn: str, dtype, ctype: str) -> np.ndarray:
    """[n_slots, kv_size] of dtype, filled by the native call ``fn(ctx, out, n_out)``."""
    ffi, lib = _api()
    ctx = context_pointer(llm)
    g = ffi.new("struct llama_entrokv_geometry *")
    _check(lib.llama_entrokv_get_geometry(ctx, g))
    out = np.empty((g.n_slots, g.kv_size), dtype=dtype)
    _check(getattr(lib, fn)(ctx, ffi.from_buffer(f"{ctype}[]", out), out.size))
    return out


def true_positions(llm) -> np.ndarray:
    """int32 [n_slots, kv_size]: the true position of the token each cell holds for
    each (layer, KV head) slot, -1 for empty cells."""
    return _slot_table(llm, "llama_entrokv_true_pos", np.int32, "int32_t")


def value_norms(llm) -> np.ndarray:
    """float32 [n_slots, kv_size]: the Euclidean norm of the value vector each cell holds for
    each (layer, KV head) slot, 0 for empty cells (read from V in whatever backend holds it)."""
    return _slot_table(llm, "llama_entrokv_value_norms", np.float32, "float")


def _int32(name: str, v) -> int:
    """v as a Python int for an int32_t argument: ValueError outside int32 (cffi would raise
    OverflowError), TypeError for what is not an integer."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {v!r}")
    if not -(2**31) <= v < 2**31:
        raise ValueError(f"{name} {v} is outside int32")
    return int(v)


def _check_int32_range(a: np.ndarray) -> None:
    if a.size and a.dtype.itemsize > 4 and (a.min() < -(2**31) or a.max() >= 2**31):
        raise ValueError("cell index outside int32")


def compact(llm, keep: np.ndarray | Sequence[Sequence[int]], *, seq_id: int = 0, graph: bool = False,
            unordered: bool = False) -> None:
    """Compact ``llm``'s cache so that, for every slot ``s``, cells ``0..K-1`` hold
    the tokens of cells ``keep[s]`` (strictly ascending, same length K for all slots).

    ``keep`` is an int array [n_slots, K] or a sequence of n_slots 1-D lists (unequal
    lengths are refused by the native code). ``graph=True`` forces the
    backend-agnostic ggml path even for host buffers; ``unordered=True`` accepts
    lists in any order (without duplicates): cell j then receives ``keep[s][j]``. Raises EntroKVError and
    leaves the cache untouched on any bad input.
    """
    ffi, lib = _api()
    ctx = context_pointer(llm)
    if isinstance(keep, np.ndarray) and keep.ndim == 2:
        # the common case: one array, checked and converted in one go
        if keep.size and not np.issubdtype(keep.dtype, np.integer):
            raise TypeError("keep must hold integer cell indices")
        _check_int32_range(keep)
        n_rows = keep.shape[0]
        lens = np.full(max(n_rows, 1), keep.shape[1], dtype=np.int32)
        flat = np.ascontiguousarray(keep, dtype=np.int32).ravel()
    else:
        rows = [np.asarray(r) for r in keep]
        for r in rows:
            if r.ndim != 1 or (r.size and r.dtype.kind not in "iu"):
                raise TypeError("each keep list must be a 1-D array of integer cell indices")
            _check_int32_range(r)
        n_rows = len(rows)
        lens = np.array([r.size for r in rows] or [0], dtype=np.int32)
        flat = np.ascontiguousarray(np.concatenate(rows) if rows else np.zeros(0), dtype=np.int32)
    if flat.size == 0:
        flat = np.zeros(1, dtype=np.int32)  # a valid pointer; the native length check refuses
    flags = (lib.LLAMA_ENTROKV_COMPACT_GRAPH if graph else 0) | (lib.LLAMA_ENTROKV_COMPACT_UNORDERED if unordered else 0)
    _check(lib.llama_entrokv_compact(ctx, _int32("seq_id", seq_id), n_rows, ffi.from_buffer("int32_t[]", lens),
                                     ffi.from_buffer("int32_t[]", flat), flags))


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
    _check_int32_range(flat)                # all lists at once (checked before the conversion to int32)
    return lens, np.ascontiguousarray(flat, np.int32)


def read_cells(llm, cells, g: KVGeometry | None = None, buffers: bool = False, keys_only: bool = False):
    """The rows of ``cells`` (n_slots lists of cell indices, one per (layer, KV head) slot):
    (k, v), each a list of n_slots uint8 arrays [len, bytes per row]: the slot's K and V
    slices of those cells, in the cache's own types (V in row form even when the cache
    stores it transposed). Reads only. ``g``: the cache's geometry, if the caller has it;
    ``buffers``: (k, v) as the two uint8 buffers the lists would be views of, slot after slot;
    ``keys_only``: V is not read (v is None)."""
    ffi, lib = _api()
    g = g or geometry(llm)
    lens, flat = _cell_lists(cells, g.n_slots)
    kb, vb = _row_bytes(g)
    k = np.empty(int((lens * kb).sum()), np.uint8)
    v = None if keys_only else np.empty(int((lens * vb).sum()), np.uint8)
    _check(lib.llama_entrokv_read_cells(context_pointer(llm), g.n_slots, ffi.from_buffer("int32_t[]", lens),
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
    ffi, lib = _api()
    g = g or geometry(llm)
    lens, flat = _cell_lists(cells, g.n_slots)
    if isinstance(true_pos, np.ndarray) and true_pos.ndim == 1 and true_pos.dtype != object:
        if true_pos.size and true_pos.dtype.kind not in "iu":
            raise TypeError("true_pos must hold integer positions")
        if true_pos.size != int(lens.sum()):
            raise ValueError("true_pos must have one position per listed cell")
        _check_int32_range(true_pos)
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
        _check(lib.llama_entrokv_write_cells(*args))
        return None
    ko, vo = np.empty_like(kk), np.empty_like(vv)
    _check(lib.llama_entrokv_swap_cells(*args, buf(ko), buf(vo)))
    return ko, vo


def rows_to_float(rows: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [n, elements]: rows (uint8 [n, bytes], as ``read_cells`` gives them) of a cache
    type (``KVGeometry.type_k`` / ``type_v``) converted to float as ggml converts them. F32 and BF16
    convert exactly, here; F16 (exactly, F16C where the CPU has it) and the quantized types in C."""
    t = _GGML_TYPE_IDS[type_name] if type_name in _GGML_TYPE_IDS else int(type_name)
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    n, nb = rows.shape
    if t in (0, 30) and nb % (4 if t == 0 else 2) == 0:
        if t == 0:
            return rows.view(np.float32).copy()
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return _ggml_to_float(rows, t)


def _ggml_to_float(rows: np.ndarray, t: int) -> np.ndarray:
    """rows_to_float through ggml's conversion of type id ``t``."""
    ffi, lib = _api()
    n, nb = rows.shape
    # elements per row: bytes / (bytes per block) * (elements per block), from one probe of the type
    per = {0: (4, 1), 1: (2, 1), 30: (2, 1), 8: (34, 32), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32),
           20: (18, 32)}
    if t not in per:
        raise ValueError(f"cache type {_GGML_TYPE_NAMES.get(t, t)} cannot be converted here")
    bb, be = per[t]
    if nb % bb:
        raise ValueError(f"a row of {nb} bytes is not whole blocks of {_GGML_TYPE_NAMES.get(t, t)}")
    out = np.empty((n, nb // bb * be), np.float32)
    if out.size:
        _check(lib.llama_entrokv_to_float(t, ffi.from_buffer("char[]", rows), ffi.from_buffer("float[]", out), out.size))
    return out


def restore(llm, true_pos: np.ndarray) -> None:
    """After loading a saved state of a compacted cache: re-attach its true-position table,
    int32 [n_slots, n_keep] (what ``true_positions(llm)[:, :n_keep]`` was at save time)."""
    ffi, lib = _api()
    tp = np.ascontiguousarray(true_pos, dtype=np.int32)
    if tp.ndim != 2:
        raise ValueError("true_pos must be [n_slots, n_keep]")
    _check(lib.llama_entrokv_restore(context_pointer(llm), tp.shape[1], ffi.from_buffer("int32_t[]", tp), tp.size))


def set_last_logits(llm, logits: np.ndarray) -> None:
    """After loading a saved state: make ``logits`` (float32 [n_vocab]) the context's
    logits of its last token, so that sampling goes on as before the save."""
    ffi, lib = _api()
    lg = np.ascontiguousarray(logits, dtype=np.float32)
    _check(lib.llama_entrokv_set_last_logits(context_pointer(llm), ffi.from_buffer("float[]", lg), lg.size))


def n_refused(llm) -> int:
    """Operations refused (since the context was created) because they would have
    corrupted compacted cells (range seq_rm, seq_add, seq_div)."""
    _, lib = _api()
    return _check(lib.llama_entrokv_n_refused(context_pointer(llm)))


def swa_trim(llm, *, seq_id: int = 0) -> int:
    """Models with sliding-window layers (``geometry(llm).is_iswa``, e.g. Gemma 3): drop the
    cells of their cache that the window has passed and move the rest to the front, so that
    those layers read about the window instead of every cell used so far. Returns the cells
    dropped. Accepted only right after a ``compact`` (through the last token), which refuses the
    cuts of the sequence that would need the dropped cells; EntroKVLlama does it after each
    eviction. Raises EntroKVError (the cache untouched) elsewhere and on a model without
    sliding-window layers."""
    ffi, lib = _api()
    out = ffi.new("int32_t *")
    _check(lib.llama_entrokv_swa_trim(context_pointer(llm), _int32("seq_id", seq_id), out))
    return int(out[0])


def _params(ffi, lib, *, budget: int, page_size: int, sinks: int, recent: int, tau: float, page_max: bool):
    p = ffi.new("struct llama_entrokv_params *", lib.llama_entrokv_default_params())
    p.budget, p.page_size = _int32("budget", budget), _int32("page_size", page_size)
    p.sinks, p.recent = _int32("sinks", sinks), _int32("recent", recent)
    p.tau, p.page_max = float(tau), int(bool(page_max))
    return p


@lru_cache(maxsize=1)
def _method_defaults() -> tuple:
    """Page-EntroKV's (page_size, sinks, recent, tau), from the one place they live (controller/config.py)."""
    from ..controller.config import EvictionConfig
    cfg = EvictionConfig(policy="page-entrokv")
    return cfg.page_size, cfg.sinks, cfg.rho, cfg.tau


def _defaults(page_size, sinks, recent, tau) -> tuple:
    """The settings given, the method's defaults for those that are not."""
    return tuple(d if v is None else v for v, d in zip((page_size, sinks, recent, tau), _method_defaults()))


def select_pages_native(scores: np.ndarray, n_head_kv: int, *, budget: int, page_size: int | None = None,
                        sinks: int | None = None, recent: int | None = None, tau: float | None = None,
                        page_max: bool = False) -> np.ndarray:
    """The C Page-EntroKV selector: scores float32 [L, H, n] -> pages int32 [L, G, N]. Settings not
    given are EvictionConfig's for page-entrokv."""
    page_size, sinks, recent, tau = _defaults(page_size, sinks, recent, tau)
    ffi, lib = _api()
    s = np.ascontiguousarray(scores, dtype=np.float32)
    if s.ndim != 3:
        raise ValueError(f"scores must be [L, H, n], got shape {s.shape}")
    L, H, n = (_int32(k, v) for k, v in zip(("L", "H", "n"), s.shape))
    G = _int32("n_head_kv", n_head_kv)
    p = _params(ffi, lib, budget=budget, page_size=page_size, sinks=sinks, recent=recent, tau=tau, page_max=page_max)
    out = np.empty(max(L * G * -(-n // max(page_size, 1)), 1), dtype=np.int32)
    N = _check(lib.llama_entrokv_select_pages(ffi.from_buffer("float[]", s), L, H, G, n, p,
                                              ffi.from_buffer("int32_t[]", out), out.size))
    return out[: L * G * N].reshape(L, G, N)


def recall_plan(att: np.ndarray, w_cache: np.ndarray, w_read: np.ndarray, ent: np.ndarray, true_pos: np.ndarray,
                protect: np.ndarray, page_size: int, store_page: int, max_groups: int,
                att_scale: np.ndarray | None = None):
    """The recall's swap decision in C (llama_entrokv_recall_plan) for S slots: att float32 [S, I, r, n_keep]
    (attention over the compacted cells), and on one scale per query the cache's total weight w_cache
    [S, I, r] and the read pages' tokens' weights w_read [S, I, r, n_read]; ent [S, n_read] (< 0: no token);
    true_pos [S, n_keep]; protect bool [eviction pages]; att_scale [S, I, r]: when given, the attention is
    att x att_scale (a float32 product per value). Returns (pages int32 [S, n_read / store_page],
    n_pages [S], cells int32 [S, n_read], n_cells [S]): per slot the read pages taken in order and the
    cells they displace (the first n_pages[s] / n_cells[s] of each row)."""
    ffi, lib = _api()
    if att.ndim != 4:
        raise ValueError(f"recall_plan: att must be [S, I, r, n_keep], got shape {att.shape}")
    S, I, r, n_keep = att.shape
    # rows of att may lie apart (a slice of a wider array, as the recall's attention is): passed with their stride
    ld = att.strides[-2] // 4 if att.dtype == np.float32 and att.strides[-1] == 4 else -1
    want = (I * r * ld * 4, r * ld * 4, ld * 4)
    dense = all(n == 1 or st == e for n, st, e in zip(att.shape[:3], att.strides[:3], want))
    if ld < n_keep or not dense or att.size == 0 or att.ctypes.data % 4:
        att, ld = np.ascontiguousarray(att, np.float32), n_keep
    wc = np.ascontiguousarray(w_cache, np.float32)
    wr = np.ascontiguousarray(w_read, np.float32)
    sc = None if att_scale is None else np.ascontiguousarray(att_scale, np.float32)
    n_read = wr.shape[-1] if wr.ndim == 4 else -1
    ent = np.where(np.asarray(ent) >= 0, 0, -1).astype(np.int32)        # only whether a token is there counts
    tp = np.asarray(true_pos)
    if tp.size and (tp.min() < 0 or tp.max() >= 2**31):
        raise ValueError(f"recall_plan: true positions must be in 0 .. 2^31 - 1, got {tp.min()} .. {tp.max()}")
    tp = np.ascontiguousarray(tp, np.int32)
    prot = np.ascontiguousarray(protect, np.uint8)
    if (wc.shape != (S, I, r) or (sc is not None and sc.shape != (S, I, r)) or wr.shape != (S, I, r, n_read)
            or ent.shape != (S, n_read) or tp.shape != (S, n_keep)):
        raise ValueError(f"recall_plan: shapes att {att.shape}, w_cache {wc.shape}, w_read {wr.shape}, ent {ent.shape}, "
                         f"true_pos {tp.shape} do not agree")
    n_pages = n_read // max(int(store_page), 1)
    pages, n_p = np.zeros((S, max(n_pages, 1)), np.int32), np.zeros(S, np.int32)
    cells, n_c = np.zeros((S, max(n_read, 1)), np.int32), np.zeros(S, np.int32)
    i32 = lambda a: ffi.from_buffer("int32_t[]", a)     # noqa: E731
    _check(lib.llama_entrokv_recall_plan(
        S, I, r, n_keep, ffi.cast("float *", att.ctypes.data), ld,
        ffi.NULL if sc is None else ffi.from_buffer("float[]", sc), ffi.from_buffer("float[]", wc),
        ffi.from_buffer("float[]", wr) if wr.size else ffi.NULL, i32(ent) if ent.size else ffi.NULL, n_read,
        i32(tp), ffi.from_buffer("uint8_t[]", prot) if prot.size else ffi.NULL, prot.size,
        _int32("page_size", page_size), _int32("store_page", store_page), _int32("max_groups", max_groups),
        i32(pages), i32(n_p), i32(cells), i32(n_c)))
    return pages[:, :n_pages], n_p, cells[:, :n_read], n_c


def recall_rank(q: np.ndarray, lse: np.ndarray, means_t: np.ndarray, counts: np.ndarray, n_out: int) -> np.ndarray:
    """The recall's digest ranking in C (llama_entrokv_recall_rank) for S slots: q float32 [S, I, r, d] the
    queries, lse [S, I, r] their log-sum-exp over the cache, means_t float32 [S, d, pages] the stored pages'
    mean keys, counts [S, pages] their stored tokens. A page's mass is, for the head that gives it most,
    the sum over the queries of min(1, count x exp(q . mean - lse)). Returns int32 [S, n_out]: per slot
    the n_out pages of largest mass among those with a token (ties: lower page first), -1 past them."""
    ffi, lib = _api()
    if q.ndim != 4 or means_t.ndim != 3:
        raise ValueError(f"recall_rank: q must be [S, I, r, d] and means_t [S, d, pages], got {q.shape}, {means_t.shape}")
    S, I, r, d = q.shape
    qq = np.ascontiguousarray(q, np.float32)
    ll = np.ascontiguousarray(lse, np.float32)
    # the means' rows may lie apart (a view of a wider array): passed with their stride
    m = means_t if means_t.dtype == np.float32 and means_t.strides[-1] == 4 else np.ascontiguousarray(means_t, np.float32)
    ld = m.strides[1] // 4
    if m.size and (m.strides[0] != d * ld * 4 or m.strides[1] % 4 or ld < m.shape[2] or m.ctypes.data % 4):
        m = np.ascontiguousarray(m)
        ld = m.shape[2]
    n_pages = m.shape[2]
    c = np.ascontiguousarray(counts, np.int32)
    if ll.shape != (S, I, r) or m.shape[:2] != (S, d) or c.shape != (S, n_pages):
        raise ValueError(f"recall_rank: shapes q {q.shape}, lse {ll.shape}, means_t {m.shape}, counts {c.shape} "
                         "do not agree")
    out = np.zeros((S, max(int(n_out), 1)), np.int32)
    if S == 0:
        return out[:, :n_out]
    _check(lib.llama_entrokv_recall_rank(
        S, I, r, d, ffi.from_buffer("float[]", qq) if qq.size else ffi.NULL,
        ffi.from_buffer("float[]", ll) if ll.size else ffi.NULL,
        ffi.cast("float *", m.ctypes.data) if m.size else ffi.NULL, max(ld, n_pages),
        ffi.from_buffer("int32_t[]", c) if c.size else ffi.NULL, n_pages, _int32("n_out", n_out),
        ffi.from_buffer("int32_t[]", out)))
    return out


def digest_update(si: np.ndarray, pages: np.ndarray, keys: np.ndarray, sign: int, sums: np.ndarray, counts: np.ndarray,
                  means_t: np.ndarray) -> None:
    """The recall store's digests after tokens come in (sign +1) or leave (-1), in place, in C
    (llama_entrokv_digest_update): token i in slot si[i], page pages[i], key keys[i] (float32 [n, d]);
    sums float32 [S, pages, d], counts int64 [S, pages], means_t float32 [S, d, pages], each C-contiguous.
    Refused (EntroKVError, nothing changed) for a slot or page out of range or a count below 0."""
    ffi, lib = _api()
    S, npg, d = sums.shape
    for a, dt, shape in ((sums, np.float32, (S, npg, d)), (counts, np.int64, (S, npg)), (means_t, np.float32, (S, d, npg))):
        if a.dtype != dt or a.shape != shape or not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"digest_update: sums [S, pages, d] float32, counts [S, pages] int64 and means_t [S, d, pages] "
                             f"float32 must be writeable C-contiguous arrays, got {sums.shape}, {counts.shape}, {means_t.shape}")
    n = int(np.size(si))
    if np.shape(pages) != (n,) or np.shape(si) != (n,) or np.shape(keys) != (n, d):
        raise ValueError(f"digest_update: si [n], pages [n], keys [n, {d}], got {np.shape(si)}, {np.shape(pages)}, "
                         f"{np.shape(keys)}")
    if not n:
        return
    for a in (si, pages):
        _check_int32_range(np.asarray(a))
    s32, p32 = np.ascontiguousarray(si, np.int32), np.ascontiguousarray(pages, np.int32)
    kf = np.ascontiguousarray(keys, np.float32)
    _check(lib.llama_entrokv_digest_update(n, ffi.from_buffer("int32_t[]", s32), ffi.from_buffer("int32_t[]", p32),
                                           ffi.from_buffer("float[]", kf), d, int(sign), S, npg,
                                           ffi.from_buffer("float[]", sums), ffi.from_buffer("int64_t[]", counts),
                                           ffi.from_buffer("float[]", means_t)))


def softmax_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A softmax in place in C (llama_entrokv_softmax_rows) over the rows of x, a float32 [A, B, n] array (a
    view whose rows may lie apart, each row's n floats contiguous, A-major): each row becomes exp(x - max) (0
    where x is -inf). Returns (lse, 1 / sum), float32 [A, B] each; EntroKVError for a row with a NaN, a +inf
    or no finite value."""
    ffi, lib = _api()
    if x.ndim != 3 or x.dtype != np.float32 or not x.flags.writeable:
        raise ValueError(f"softmax_rows: x must be a writable float32 [A, B, n] array, got {x.dtype} {x.shape}")
    A, B, n = x.shape
    if x.strides[2] != 4 or x.strides[1] % 4 or x.strides[0] % 4 or min(x.strides) < 0 or x.ctypes.data % 4:
        raise ValueError(f"softmax_rows: each row's floats must be contiguous (strides {x.strides})")
    lse, inv = np.empty((A, B), np.float32), np.empty((A, B), np.float32)
    if x.size:
        _check(lib.llama_entrokv_softmax_rows(ffi.cast("float *", x.ctypes.data), A, x.strides[0] // 4 if A > 1 else 0,
                                              B, x.strides[1] // 4 if B > 1 else n, n, ffi.from_buffer("float[]", lse),
                                              ffi.from_buffer("float[]", inv)))
    return lse, inv


def evict_native(llm, *, budget: int, page_size: int | None = None, sinks: int | None = None,
                 recent: int | None = None, tau: float | None = None, page_max: bool = False, seq_id: int = 0) -> int:
    """The C one-call eviction (last observed scores, then compaction); returns tokens kept per group.
    Settings not given are EvictionConfig's for page-entrokv."""
    page_size, sinks, recent, tau = _defaults(page_size, sinks, recent, tau)
    ffi, lib = _api()
    p = _params(ffi, lib, budget=budget, page_size=page_size, sinks=sinks, recent=recent, tau=tau, page_max=page_max)
    return _check(lib.llama_entrokv_evict(context_pointer(llm), _int32("seq_id", seq_id), p))
