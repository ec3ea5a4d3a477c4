"""What the runtime must respect of the machine it runs on: ggml's thread limit, the sizes llama.cpp
takes, and the heap's freed memory given back."""
from __future__ import annotations

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
