"""Typed Python wrappers over our C API, through cffi (ABI mode): the cache's geometry and
true positions, compaction, the restore calls and the observers' callbacks. The rows of cells
are in ``rows.py``, the numeric kernels (the C selector, the recall's) in ``kernels.py``.

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
GGML_TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16", 20: "iq4_nl"}
GGML_TYPE_IDS = {v: k for k, v in GGML_TYPE_NAMES.items()}


def _cdef_source(header: str) -> str:
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", header, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return ("struct llama_context;\ntypedef int32_t llama_seq_id;\ntypedef int32_t llama_pos;\n"
            + text.replace("LLAMA_API", ""))


@lru_cache(maxsize=None)
def c_api():
    """(ffi, lib): cffi's FFI with our header's declarations, and libllama opened through it."""
    ffi = FFI()
    ffi.cdef(_cdef_source((include_dir() / "llama-entrokv.h").read_text()))
    lib = ffi.dlopen(str(lib_dir() / LIBLLAMA))
    return ffi, lib


class EntroKVError(RuntimeError):
    """A refusal or failure of the native API; the cache is left as it was.

    ``code`` is the negative ``llama_entrokv_status`` value, ``name`` its enum name.
    """

    def __init__(self, code: int, message: str):
        ffi, lib = c_api()
        self.code = int(code)
        self.name = next(
            (n for n in dir(lib) if n.startswith("LLAMA_ENTROKV_ERR_") and getattr(lib, n) == code), "UNKNOWN"
        )
        self.message = message
        super().__init__(f"{self.name}: {message}")


def check(rc: int) -> int:
    if rc < 0:
        ffi, lib = c_api()
        raise EntroKVError(rc, ffi.string(lib.llama_entrokv_last_error()).decode("utf-8", "replace"))
    return rc


def context_pointer(obj):
    """A cffi ``struct llama_context *`` from a llama_cpp.Llama, its LlamaContext,
    a ctypes pointer or an integer address."""
    ffi, _ = c_api()
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
    ffi, lib = c_api()
    ctx = context_pointer(llm)
    g = ffi.new("struct llama_entrokv_geometry *")
    check(lib.llama_entrokv_get_geometry(ctx, g))
    layers = []
    li = ffi.new("struct llama_entrokv_layer *")
    for i in range(g.n_layers):
        check(lib.llama_entrokv_get_layer(ctx, i, li))
        layers.append(KVLayer(li.il, li.n_head_kv, li.head_dim_k, li.head_dim_v, li.slot0,
                              bool(li.on_host), int(li.k_bytes_per_cell), int(li.v_bytes_per_cell)))
    return KVGeometry(
        n_layers=g.n_layers, n_slots=g.n_slots, kv_size=g.kv_size, n_used=g.n_used,
        v_trans=bool(g.v_trans), is_iswa=bool(g.is_iswa),
        type_k=GGML_TYPE_NAMES.get(g.type_k, str(g.type_k)), type_v=GGML_TYPE_NAMES.get(g.type_v, str(g.type_v)),
        n_compacted=g.n_compacted, n_compactions=g.n_compactions, pos_max=g.pos_max,
        host_buffers=bool(g.host_buffers), layers=tuple(layers),
    )


def used_cells(llm) -> int:
    """Cells of the (compactable) cache that hold a token: one native call, for hot paths."""
    ffi, lib = c_api()
    g = ffi.new("struct llama_entrokv_geometry *")
    check(lib.llama_entrokv_get_geometry(context_pointer(llm), g))
    return int(g.n_used)


def _slot_table(llm, fn: str, dtype, ctype: str) -> np.ndarray:
    """[n_slots, kv_size] of dtype, filled by the native call ``fn(ctx, out, n_out)``."""
    ffi, lib = c_api()
    ctx = context_pointer(llm)
    g = ffi.new("struct llama_entrokv_geometry *")
    check(lib.llama_entrokv_get_geometry(ctx, g))
    out = np.empty((g.n_slots, g.kv_size), dtype=dtype)
    check(getattr(lib, fn)(ctx, ffi.from_buffer(f"{ctype}[]", out), out.size))
    return out


def true_positions(llm) -> np.ndarray:
    """int32 [n_slots, kv_size]: the true position of the token each cell holds for
    each (layer, KV head) slot, -1 for empty cells."""
    return _slot_table(llm, "llama_entrokv_true_pos", np.int32, "int32_t")


def value_norms(llm) -> np.ndarray:
    """float32 [n_slots, kv_size]: the Euclidean norm of the value vector each cell holds for
    each (layer, KV head) slot, 0 for empty cells (read from V in whatever backend holds it)."""
    return _slot_table(llm, "llama_entrokv_value_norms", np.float32, "float")


def int32_arg(name: str, v) -> int:
    """v as a Python int for an int32_t argument: ValueError outside int32 (cffi would raise
    OverflowError), TypeError for what is not an integer."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {v!r}")
    if not -(2**31) <= v < 2**31:
        raise ValueError(f"{name} {v} is outside int32")
    return int(v)


def check_int32_range(a: np.ndarray) -> None:
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
    ffi, lib = c_api()
    ctx = context_pointer(llm)
    if isinstance(keep, np.ndarray) and keep.ndim == 2:
        # the common case: one array, checked and converted in one go
        if keep.size and not np.issubdtype(keep.dtype, np.integer):
            raise TypeError("keep must hold integer cell indices")
        check_int32_range(keep)
        n_rows = keep.shape[0]
        lens = np.full(max(n_rows, 1), keep.shape[1], dtype=np.int32)
        flat = np.ascontiguousarray(keep, dtype=np.int32).ravel()
    else:
        rows = [np.asarray(r) for r in keep]
        for r in rows:
            if r.ndim != 1 or (r.size and r.dtype.kind not in "iu"):
                raise TypeError("each keep list must be a 1-D array of integer cell indices")
            check_int32_range(r)
        n_rows = len(rows)
        lens = np.array([r.size for r in rows] or [0], dtype=np.int32)
        flat = np.ascontiguousarray(np.concatenate(rows) if rows else np.zeros(0), dtype=np.int32)
    if flat.size == 0:
        flat = np.zeros(1, dtype=np.int32)  # a valid pointer; the native length check refuses
    flags = (lib.LLAMA_ENTROKV_COMPACT_GRAPH if graph else 0) | (lib.LLAMA_ENTROKV_COMPACT_UNORDERED if unordered else 0)
    check(lib.llama_entrokv_compact(ctx, int32_arg("seq_id", seq_id), n_rows, ffi.from_buffer("int32_t[]", lens),
                                     ffi.from_buffer("int32_t[]", flat), flags))


def restore(llm, true_pos: np.ndarray) -> None:
    """After loading a saved state of a compacted cache: re-attach its true-position table,
    int32 [n_slots, n_keep] (what ``true_positions(llm)[:, :n_keep]`` was at save time)."""
    ffi, lib = c_api()
    tp = np.ascontiguousarray(true_pos, dtype=np.int32)
    if tp.ndim != 2:
        raise ValueError("true_pos must be [n_slots, n_keep]")
    check(lib.llama_entrokv_restore(context_pointer(llm), tp.shape[1], ffi.from_buffer("int32_t[]", tp), tp.size))


def set_last_logits(llm, logits: np.ndarray) -> None:
    """After loading a saved state: make ``logits`` (float32 [n_vocab]) the context's
    logits of its last token, so that sampling goes on as before the save."""
    ffi, lib = c_api()
    lg = np.ascontiguousarray(logits, dtype=np.float32)
    check(lib.llama_entrokv_set_last_logits(context_pointer(llm), ffi.from_buffer("float[]", lg), lg.size))


def n_refused(llm) -> int:
    """Operations refused (since the context was created) because they would have
    corrupted compacted cells (range seq_rm, seq_add, seq_div)."""
    _, lib = c_api()
    return check(lib.llama_entrokv_n_refused(context_pointer(llm)))


def swa_trim(llm, *, seq_id: int = 0) -> int:
    """Models with sliding-window layers (``geometry(llm).is_iswa``, e.g. Gemma 3): drop the
    cells of their cache that the window has passed and move the rest to the front, so that
    those layers read about the window instead of every cell used so far. Returns the cells
    dropped. Accepted only right after a ``compact`` (through the last token), which refuses the
    cuts of the sequence that would need the dropped cells; EntroKVLlama does it after each
    eviction. Raises EntroKVError (the cache untouched) elsewhere and on a model without
    sliding-window layers."""
    ffi, lib = c_api()
    out = ffi.new("int32_t *")
    check(lib.llama_entrokv_swa_trim(context_pointer(llm), int32_arg("seq_id", seq_id), out))
    return int(out[0])


# --- observers: callbacks from inside llama_decode ----------------------------------------------

OBSERVERS = ("scores", "queries", "decode")


def observer_callback(fn):
    """A C observer (``llama_entrokv_observer``) that calls ``fn(scores)`` with the native
    ``struct llama_entrokv_scores *``; keep it alive while it is installed."""
    ffi, _ = c_api()
    return ffi.callback("void(void *, const struct llama_entrokv_scores *)", lambda user_data, s: fn(s))


def set_observer(llm, kind: str, window: int, callback) -> None:
    """Install ``callback`` (from ``observer_callback``) as ``llm``'s observer of ``kind``: "scores" (the
    window's attention over the cache, and its queries), "queries" (its queries only) or "decode" (every
    ubatch's last query and its attention as the decode computed it); ``callback`` None: none."""
    ffi, lib = c_api()
    ctx = context_pointer(llm)
    if callback is None:
        check(lib.llama_entrokv_set_observer(ctx, 0, ffi.NULL, ffi.NULL))
    elif kind == "decode":
        check(lib.llama_entrokv_set_decode_observer(ctx, callback, ffi.NULL))
    elif kind == "queries":
        check(lib.llama_entrokv_set_query_observer(ctx, window, callback, ffi.NULL))
    elif kind == "scores":
        check(lib.llama_entrokv_set_observer(ctx, window, callback, ffi.NULL))
    else:
        raise ValueError(f"observer kind must be one of {', '.join(OBSERVERS)}, got {kind!r}")


def observed_arrays(s) -> tuple:
    """Zero-copy numpy views of an observer's ``struct llama_entrokv_scores`` (valid during the call):
    scores float32 [L, H, n_kv] (0 cells for a queries-only observation), true_pos int32 [n_slots, n_kv],
    layer_ids int32 [L], queries float32 [L, window, H, head_dim] or None, rows float32 [L, H, n_rows] or None."""
    ffi, _ = c_api()
    L, H, n_kv, ns = s.n_layers, s.n_head, s.n_kv, s.n_slots
    if s.scores == ffi.NULL:        # an observation of the queries only
        scores, tpos = np.zeros((L, H, 0), np.float32), np.zeros((ns, 0), np.int32)
    else:
        scores = np.frombuffer(ffi.buffer(s.scores, L * H * n_kv * 4), dtype=np.float32).reshape(L, H, n_kv)
        tpos = np.frombuffer(ffi.buffer(s.true_pos, ns * n_kv * 4), dtype=np.int32).reshape(ns, n_kv)
    ids = np.frombuffer(ffi.buffer(s.layer_ids, L * 4), dtype=np.int32)
    q = None
    if s.head_dim > 0 and s.queries != ffi.NULL:
        q = np.frombuffer(ffi.buffer(s.queries, L * s.window * H * s.head_dim * 4),
                          dtype=np.float32).reshape(L, s.window, H, s.head_dim)
    rows = None
    if s.n_rows > 0 and s.rows != ffi.NULL:
        rows = np.frombuffer(ffi.buffer(s.rows, L * H * s.n_rows * 4), dtype=np.float32).reshape(L, H, s.n_rows)
    return scores, tpos, ids, q, rows
