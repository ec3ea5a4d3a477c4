"""An independent reference for the observation-window scores: Q and K captured with
llama.cpp's eval callback (the model's own Qcur/Kcur after RoPE), attention recomputed
in numpy. Uses the low-level API, since llama_cpp.Llama does not expose cb_eval."""
from __future__ import annotations

import numpy as np
from cffi import FFI

from entrokv_edge._paths import lib_dir
from llama_cpp import llama_cpp as C

_ffi = FFI()
_ffi.cdef("""
    struct ggml_tensor { int type; void * buffer; int64_t ne[4]; size_t nb[4]; };  /* leading fields only */
    const char * ggml_get_name(const struct ggml_tensor * t);
    size_t ggml_nbytes(const struct ggml_tensor * t);
    void ggml_backend_tensor_get(const struct ggml_tensor * t, void * data, size_t offset, size_t size);
""")
_ggml = _ffi.dlopen(str(lib_dir() / "libggml-base.so"))



class CapturingContext:
    """A llama context whose eval callback keeps the last Qcur-N / Kcur-N of every layer."""

    def __init__(self, path, *, n_ctx=512, flash_attn=False, type_k=1, threads=2):
        self.captured: dict[str, np.ndarray] = {}

        def cb(t, ask, _ud):
            tt = _ffi.cast("struct ggml_tensor *", t)
            name = _ffi.string(_ggml.ggml_get_name(tt)).decode()
            wanted = name.startswith("Qcur-") or name.startswith("Kcur-")
            if ask:
                return wanted
            if wanted and tt.type == 0:  # F32
                ne = [tt.ne[i] for i in range(4)]
                buf = np.empty(int(np.prod(ne)), dtype=np.float32)
                contiguous = tt.nb[0] == 4 and tt.nb[1] == 4 * ne[0] and tt.nb[2] == tt.nb[1] * ne[1]
                if contiguous:
                    _ggml.ggml_backend_tensor_get(tt, _ffi.from_buffer(buf), 0, buf.nbytes)
                    self.captured[name] = buf.reshape(ne[3], ne[2], ne[1], ne[0])[0]  # [T, heads, hd]
            return True

        self._cb = C.ggml_backend_sched_eval_callback(cb)
        mp = C.llama_model_default_params()
        self.model = C.llama_model_load_from_file(str(path).encode(), mp)
        cp = C.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 1 if flash_attn else 0
        cp.type_k = cp.type_v = type_k
        cp.cb_eval = self._cb
        cp.cb_eval_user_data = None
        self.ctx = C.llama_init_from_model(self.model, cp)
        assert self.ctx, "context creation failed"

    def decode(self, tokens) -> None:
        arr = (C.llama_token * len(tokens))(*[int(t) for t in tokens])
        assert C.llama_decode(self.ctx, C.llama_batch_get_one(arr, len(tokens))) == 0

    def close(self) -> None:
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)


def reference_scores(q: np.ndarray, k: np.ndarray, window: int, scale: float) -> np.ndarray:
    """[H, T]: mean over the last ``window`` queries of softmax(q.k * scale) over causal keys.
    q [T, H, d], k [T, G, d]; query head h reads KV head h // (H / G)."""
    T, H, _ = q.shape
    r = H // k.shape[1]
    kk = np.repeat(k, r, axis=1).astype(np.float64)                   # [T, H, d]
    qw = q[T - window:].astype(np.float64)                            # [w, H, d]
    logits = np.einsum("ihd,thd->hit", qw, kk) * scale                # [H, w, T]
    i = np.arange(T - window, T)[:, None]
    logits = np.where(np.arange(T)[None, :] <= i, logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    a = np.exp(logits)
    a /= a.sum(axis=-1, keepdims=True)
    return a.mean(axis=1)
