"""What a compacted cache needs to be saved and restored: ``EntroKVState`` in memory, and
session files that cannot be misread.

A state holds llama.cpp's state blob, the logical tokens, the true-position table of the
compacted cells, the last logits (a compacted cell cannot be re-evaluated), the freshest
window scores, the eviction settings, and what it belongs to: the model's identity (a hash of
the GGUF header, ``models.model_identity``) and the cache's geometry and types. A session file
is an ``.npz`` archive of those arrays plus a JSON header that names its format, every
array's sha256 and its own; it is written to a temporary file and renamed, so an interrupted
save never leaves a file that loads.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from .._loader import ensure_llama_cpp
from ..bindings.observe import WindowScores

llama_cpp = ensure_llama_cpp()

FORMAT = "entrokv-session-2"
# the arrays of a session file, besides "meta" (the JSON header) and "meta_sha256"
_ARRAYS = ("llama_state", "logits", "input_ids", "true_pos")
_WS = ("ws_scores", "ws_true_pos", "ws_layers", "ws_info")
_RECALL = ("recall_pos", "recall_k", "recall_v", "recall_info", "recall_q", "recall_qpos")
_HELD = ("recall_hq", "recall_hpos")       # a turn's draft queries, held (recall's hold_draft)
_ROWS = ("recall_rows",)                   # the decoded tokens' attention as the decode computed it, where it did


class SessionError(ValueError):
    """A session file or state that cannot be loaded here (unreadable, corrupted, or made for
    another model, cache or version); the context is left as it was."""


class EntroKVState(llama_cpp.LlamaState):
    """llama-cpp-python's ``LlamaState`` (what ``Llama.save_state`` returns and its caches keep),
    with what a compacted cache needs besides: ``logits`` (float32 [n_vocab], the last token's),
    ``true_pos`` (int32 [n_slots, n_compacted]), ``window_scores`` (or None), ``settings`` (the
    EvictionConfig fields), ``identity`` (model and cache geometry), ``extra`` and ``recall`` (the
    recall store's arrays, runtime/recall/; empty without one)."""

    def __init__(self, *, input_ids: np.ndarray, n_tokens: int, llama_state: bytes, seed: int, logits: np.ndarray,
                 true_pos: np.ndarray, window_scores: WindowScores | None, settings: dict, identity: dict,
                 extra: dict | None = None, recall: dict | None = None):
        super().__init__(input_ids=input_ids, scores=np.zeros((0, logits.size), np.float32), n_tokens=n_tokens,
                         llama_state=llama_state, llama_state_size=len(llama_state), seed=seed)
        self.logits = logits
        self.true_pos = true_pos
        self.window_scores = window_scores
        self.settings = settings
        self.identity = identity
        self.extra = extra or {}
        self.recall = recall or {}

    @property
    def nbytes(self) -> int:
        """Bytes this state holds in memory (what a cache of states counts)."""
        ws = self.window_scores
        return (len(self.llama_state) + self.input_ids.nbytes + self.logits.nbytes + self.true_pos.nbytes
                + (ws.scores.nbytes + ws.true_pos.nbytes + (ws.queries.nbytes if ws.queries is not None else 0)
                   if ws is not None else 0)
                + sum(a.nbytes for a in self.recall.values()))


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _arrays(state: EntroKVState) -> dict[str, np.ndarray]:
    out = {"llama_state": np.frombuffer(state.llama_state, dtype=np.uint8),
           "logits": np.asarray(state.logits, dtype=np.float32),
           "input_ids": np.asarray(state.input_ids[: state.n_tokens], dtype=np.int32),
           "true_pos": np.asarray(state.true_pos, dtype=np.int32)}
    ws = state.window_scores
    if ws is not None:
        out.update(ws_scores=np.asarray(ws.scores), ws_true_pos=np.asarray(ws.true_pos, dtype=np.int32),
                   ws_layers=np.asarray(ws.layer_ids, dtype=np.int32),
                   ws_info=np.array([ws.window, ws.n_tokens, ws.pos_last], np.int64))
    if state.recall:
        out.update({k: np.asarray(state.recall[k]) for k in _RECALL + _HELD + _ROWS if k in state.recall})
    return out


def write(path: str | os.PathLike, state: EntroKVState) -> None:
    """Write ``state`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    path = Path(path)
    arrays = _arrays(state)
    meta = {"format": FORMAT, "n_tokens": int(state.n_tokens), "seed": int(state.seed), "settings": state.settings,
            "identity": state.identity, "extra": state.extra,
            "checksums": {k: _sha(v) for k, v in arrays.items()}}
    meta_bytes = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    arrays.update(meta=meta_bytes, meta_sha256=np.frombuffer(_sha(meta_bytes).encode(), dtype=np.uint8))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read(path: str | os.PathLike) -> EntroKVState:
    """The state saved in ``path``, every checksum verified; SessionError otherwise."""
    name = str(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except Exception as e:   # noqa: BLE001 - a damaged archive raises many kinds: BadZipFile, ValueError, EOFError,
        # RuntimeError ('encrypted' flag), NotImplementedError (compression method), struct.error, ...
        raise SessionError(f"{name}: not an EntroKV Edge session file, or a damaged one "
                           f"({type(e).__name__}: {e})") from e
    if "meta" not in arrays:
        raise SessionError(f"{name}: not an EntroKV Edge session file (no header)")
    try:
        meta = json.loads(bytes(arrays["meta"]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SessionError(f"{name}: damaged session file (its header is not readable: {e})") from e
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt == "entrokv-session-1":
        raise SessionError(f"{name}: saved by an older EntroKV Edge (format 1, without checksums or model identity); "
                           "it cannot be verified, so it is not loaded")
    if fmt != FORMAT:
        raise SessionError(f"{name}: unknown session format {fmt!r} (this version reads {FORMAT})")
    if "meta_sha256" not in arrays or bytes(arrays["meta_sha256"]).decode("ascii", "replace") != _sha(arrays["meta"]):
        raise SessionError(f"{name}: damaged session file (its header's checksum does not match)")
    sums = meta.get("checksums", {})
    # recall_qpos: absent from a store saved before the decoded tokens' attention was computed at the recall
    # (it kept their attention instead): the store loads, those tokens' queries do not
    recall = {*_RECALL} - ({"recall_qpos"} if "recall_qpos" not in sums else set())
    recall |= {*_HELD} if "recall_hq" in sums else set()
    recall |= {*_ROWS} if "recall_rows" in sums else set()
    want = set(_ARRAYS) | ({*_WS} if "ws_scores" in sums else set()) | (recall if "recall_pos" in sums else set())
    for k in sorted(want):
        if k not in arrays or k not in sums:
            raise SessionError(f"{name}: damaged session file (array {k!r} is missing)")
        if _sha(arrays[k]) != sums[k]:
            raise SessionError(f"{name}: damaged session file (the checksum of {k!r} does not match)")
    try:
        return _state(arrays, meta, "ws_scores" in sums)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise SessionError(f"{name}: damaged session file ({type(e).__name__}: {e})") from e


def _state(arrays: dict, meta: dict, with_scores: bool) -> EntroKVState:
    """The state of a file whose checksums held (a file that does not fit raises ValueError,
    KeyError, TypeError or IndexError)."""
    ws = None
    if with_scores:
        info = arrays["ws_info"]
        ws = WindowScores(arrays["ws_scores"], arrays["ws_true_pos"], arrays["ws_layers"], int(info[0]),
                          int(info[1]), int(info[2]))
    n = int(meta["n_tokens"])
    if arrays["input_ids"].size != n:
        raise ValueError(f"{arrays['input_ids'].size} tokens for {n}")
    if not isinstance(meta["settings"], dict) or not isinstance(meta["identity"], dict):
        raise TypeError("settings and identity must be objects")
    return EntroKVState(input_ids=arrays["input_ids"], n_tokens=n, llama_state=arrays["llama_state"].tobytes(),
                        seed=int(meta["seed"]), logits=arrays["logits"], true_pos=arrays["true_pos"],
                        window_scores=ws, settings=meta["settings"], identity=meta["identity"],
                        extra=meta.get("extra", {}), recall={k: arrays[k] for k in _RECALL + _HELD + _ROWS if k in arrays})


def mismatch(saved: dict, here: dict) -> str | None:
    """What differs between a state's identity and this context's (None: they match)."""
    labels = {"model": "another model", "model_name": None, "kv_cells": "a cache of another size",
              "n_vocab": "another vocabulary", "geometry": "another cache layout or type"}
    for k, what in labels.items():
        if what is not None and saved.get(k) != here.get(k):
            if k == "kv_cells":
                return f"it was saved with a {saved.get(k)}-cell cache, this one has {here.get(k)}"
            if k == "model":
                return (f"it was saved with another model ({saved.get('model_name') or 'unknown'}, identity "
                        f"{str(saved.get(k))[:12]}; this one is {here.get('model_name')}, {str(here.get(k))[:12]})")
            return f"it was saved with {what} ({saved.get(k)} vs {here.get(k)})"
    return None
