"""Test helpers: contexts, logits, and an independent compaction oracle that rewrites
the serialized sequence state (llama_state_seq_get_data) in Python."""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import numpy as np

import entrokv_edge as ek
from llama_cpp import Llama
from llama_cpp import llama_cpp as C

GGML = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


def make_llm(path, *, n_ctx=256, type_k="f16", type_v=None, flash_attn=False, n_threads=2, **kw) -> Llama:
    return Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, type_k=GGML[type_k],
                 type_v=GGML[type_v or type_k], flash_attn=flash_attn, verbose=False, seed=0,
                 n_threads=n_threads, n_threads_batch=n_threads, **kw)


def logits(llm: Llama) -> np.ndarray:
    """float32 [n_vocab]: the logits of the last evaluated token."""
    ptr = C.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def feed(llm: Llama, toks) -> np.ndarray:
    llm.eval([int(t) for t in toks])
    return logits(llm)


def greedy(llm: Llama, first: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    """Decode n tokens greedily starting by feeding ``first``; returns tokens and logits."""
    toks, outs, t = [], [], first
    for _ in range(n):
        lg = feed(llm, [t])
        outs.append(lg)
        t = int(np.argmax(lg))
        toks.append(t)
    return toks, outs


def state_blob(llm: Llama, seq: int = 0) -> bytes:
    size = C.llama_state_seq_get_size(llm.ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    n = C.llama_state_seq_get_data(llm.ctx, buf, size, seq)
    return bytes(buf[:n])


def load_blob(llm: Llama, blob: bytes, tokens, seq: int = 0) -> None:
    """Load a sequence state into a fresh Llama and tell llama-cpp-python its logical tokens."""
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    n = C.llama_state_seq_set_data(llm.ctx, buf, len(blob), seq)
    assert n == len(blob), "llama_state_seq_set_data refused the blob"
    toks = [int(t) for t in tokens]
    llm.n_tokens = len(toks)
    llm.input_ids[: len(toks)] = toks


# --- the serialized KV cache of one sequence (llama_kv_cache::state_write) ------------------

@dataclass
class CacheBlob:
    pos: np.ndarray          # int32 [n_cells]
    v_trans: bool
    k: list                  # per layer: (type, row_bytes, uint8 [n_cells, row_bytes])
    v: list                  # per layer: non-trans as k; trans: (type, el, n_embd_v, uint8 [n_embd_v, n_cells, el])
    rest: bytes              # what follows (an iswa model's SWA cache)
    head: bytes = b""        # llama_context's magic and seq id


def parse_cache(blob: bytes) -> CacheBlob:
    off = 0

    def take(fmt):
        nonlocal off
        vals = struct.unpack_from(fmt, blob, off)
        off += struct.calcsize(fmt)
        return vals if len(vals) > 1 else vals[0]

    def raw(n):
        nonlocal off
        out = np.frombuffer(blob, dtype=np.uint8, count=n, offset=off)
        off += n
        return out

    assert take("<I") == 0xAF143CD8, "sequence state magic"
    take("<i")  # seq id
    head = blob[:off]
    assert take("<I") == 1, "one stream expected"
    n = take("<I")
    pos = np.empty(n, dtype=np.int32)
    for i in range(n):
        pos[i], n_seq = take("<iI")
        for _ in range(n_seq):
            take("<i")
    v_trans, n_layer = take("<II")
    k = []
    for _ in range(n_layer):
        t, row = take("<iQ")
        k.append((t, row, raw(n * row).reshape(n, row)))
    v = []
    for _ in range(n_layer):
        if not v_trans:
            t, row = take("<iQ")
            v.append((t, row, raw(n * row).reshape(n, row)))
        else:
            t, el, ne = take("<iII")
            v.append((t, el, ne, raw(ne * n * el).reshape(ne, n, el)))
    return CacheBlob(pos, bool(v_trans), k, v, blob[off:], head)


def write_cache(c: CacheBlob) -> bytes:
    out = [c.head, struct.pack("<II", 1, len(c.pos))]
    for p in c.pos:
        out.append(struct.pack("<iIi", int(p), 1, 0))
    out.append(struct.pack("<II", int(c.v_trans), len(c.k)))
    for t, row, data in c.k:
        out += [struct.pack("<iQ", t, row), np.ascontiguousarray(data).tobytes()]
    for entry in c.v:
        if not c.v_trans:
            t, row, data = entry
            out += [struct.pack("<iQ", t, row), np.ascontiguousarray(data).tobytes()]
        else:
            t, el, ne, data = entry
            out += [struct.pack("<iII", t, el, ne), np.ascontiguousarray(data).tobytes()]
    out.append(c.rest)
    return b"".join(out)


def oracle_blob(full_blob: bytes, geo: ek.KVGeometry, sel: np.ndarray) -> bytes:
    """Apply a per-slot selection to a full cache's blob, independently of the native code.

    ``sel`` [n_slots, K] holds, per slot, indices into the blob's cells (which, for an
    uncompacted single sequence, are the true positions in order). The result holds K
    cells at positions pmax-K+1..pmax, as the native compaction leaves them."""
    c = parse_cache(full_blob)
    K = sel.shape[1]
    pmax = int(c.pos.max())
    new_k, new_v = [], []
    def gather_rows(entry, nh, s0):
        """cells in rows, each head a contiguous byte range of the row"""
        t, row, data = entry
        hb = row // nh
        out = np.empty((K, row), dtype=np.uint8)
        for h in range(nh):
            out[:, h * hb:(h + 1) * hb] = data[sel[s0 + h], h * hb:(h + 1) * hb]
        return t, row, out

    for li, layer in enumerate(geo.layers):
        nh, s0 = layer.n_head_kv, layer.slot0
        new_k.append(gather_rows(c.k[li], nh, s0))
        if not c.v_trans:
            new_v.append(gather_rows(c.v[li], nh, s0))
        else:
            t, el, ne, data = c.v[li]
            hd = ne // nh
            nv = np.empty((ne, K, el), dtype=np.uint8)
            for h in range(nh):
                nv[h * hd:(h + 1) * hd] = data[h * hd:(h + 1) * hd][:, sel[s0 + h], :]
            new_v.append((t, el, ne, nv))
    out = CacheBlob(np.arange(pmax - K + 1, pmax + 1, dtype=np.int32), c.v_trans, new_k, new_v, c.rest, c.head)
    return write_cache(out)


def random_keep(rng, n_slots: int, n_cells: int, K: int, protect: int = 0) -> np.ndarray:
    """int32 [n_slots, K]: per slot, a sorted random subset of 0..n_cells-1 that always
    holds the last ``protect`` cells."""
    rows = []
    for _ in range(n_slots):
        tail = np.arange(n_cells - protect, n_cells)
        head = rng.choice(n_cells - protect, K - protect, replace=False)
        rows.append(np.sort(np.concatenate([head, tail])))
    return np.stack(rows).astype(np.int32)
