"""What the runtime must respect of the machine it runs on: ggml's thread limit, the sizes llama.cpp
takes, and the heap's freed memory given back."""
from __future__ import annotations

import contextlib
import ctypes

MAX_THREADS = 512          # ggml's GGML_MAX_N_THREADS: a larger thread count crashes inside ggml


def check_context_params(kwargs: dict) -> None:
    """Refuse what llama-cpp-python passes on unchecked and llama.cpp cannot take: more threads than
    ggml's maximum (a segfault), a cache size outside uint32 (silently truncated)."""
    for k in ("n_threads", "n_threads_batch"):
        v = kwargs.get(k)
        if v is not None and v > MAX_THREADS:
            raise ValueError(f"{k} must be at most {MAX_THREADS} (ggml's limit), got {v}")
    for k in ("n_ctx", "n_batch", "n_ubatch"):
        v = kwargs.get(k)
        if v is not None and not 0 <= v < 2**32:
            raise ValueError(f"{k} must be in 0..2^32-1, got {v}")


# the KV cache types llama.cpp takes (its -ctk / -ctv names) and their ggml ids
CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "iq4_nl": 20}
QUANTIZED = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"}


def cache_type(value) -> int:
    """A cache type as llama.cpp's ggml id: a name of CACHE_TYPES or its id; ValueError otherwise."""
    if isinstance(value, str):
        if value.lower() not in CACHE_TYPES:
            raise ValueError(f"unknown KV cache type {value!r}; choose one of {', '.join(CACHE_TYPES)}")
        return CACHE_TYPES[value.lower()]
    if isinstance(value, bool) or not isinstance(value, int) or value not in CACHE_TYPES.values():
        raise ValueError(f"unknown KV cache type {value!r}; choose one of {', '.join(CACHE_TYPES)} (or their ggml ids)")
    return int(value)


def cache_type_name(t: int) -> str:
    return next(k for k, v in CACHE_TYPES.items() if v == t)


def check_cache_types(kwargs: dict) -> None:
    """``type_k`` / ``type_v`` given by name or ggml id, as ids in place; a quantized V without flash
    attention (llama.cpp cannot run it) refused with a clear ValueError."""
    for k in ("type_k", "type_v"):
        if kwargs.get(k) is not None:
            kwargs[k] = cache_type(kwargs[k])
    tv = kwargs.get("type_v")
    if tv is not None and cache_type_name(tv) in QUANTIZED and not kwargs.get("flash_attn"):
        raise ValueError(f"a quantized V cache ({cache_type_name(tv)}) needs flash attention: give flash_attn=True "
                         "(on the command line: -fa on)")


def _load_malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim()


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``; nothing elsewhere).
    An eviction frees tens of MiB of short-lived arrays (scores, the rows it sets aside); glibc keeps
    freed memory of that size in the heap for reuse, in pieces that later allocations of other sizes do
    not fill, and the process's resident memory grows with every eviction of a long read. A few
    milliseconds; called after each eviction and after each piece of a prompt read in pieces (not after
    each decoded token)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


_BLAS = None        # threadpoolctl's controller of the BLAS libraries loaded (found once: a few ms)


def blas_threads(n: int):
    """A context in which numpy's BLAS (OpenBLAS, MKL, BLIS) runs on at most ``n`` threads: the runtime's numpy
    work (scores, selections, the recall's products) runs between llama.cpp's decodes, on the threads the
    runtime was given, not on one per core whatever the user asked (about 20 microseconds a call)."""
    global _BLAS
    if _BLAS is None:
        try:
            from threadpoolctl import ThreadpoolController
            _BLAS = ThreadpoolController()
        except ImportError:            # (a dependency: only an install without it lacks it)
            _BLAS = False
    if not _BLAS or n is None or n < 1:
        return contextlib.nullcontext()
    return _BLAS.limit(limits=int(n), user_api="blas")
