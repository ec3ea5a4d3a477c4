"""Make llama-cpp-python run on our patched libllama.

llama-cpp-python resolves every binding when ``llama_cpp`` is first imported, from
``$LLAMA_CPP_LIB_PATH`` if set. We set it to our library directory before that
import, and refuse to go on if ``llama_cpp`` was already imported against another
libllama: our native API would then act on a context of a different library.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ._paths import LIBLLAMA, lib_dir


class LibraryMismatchError(ImportError):
    """llama_cpp was imported before entrokv_edge, against another libllama."""


def _mapped_libllama() -> list[Path]:
    """Paths of every libllama mapped into this process (Linux), [] if unknown."""
    try:
        with open("/proc/self/maps") as f:
            names = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and LIBLLAMA in line}
    except OSError:
        return []
    return sorted(Path(n).resolve() for n in names if n.endswith(LIBLLAMA))


def _loaded_by_llama_cpp() -> Path | None:
    mod = sys.modules.get("llama_cpp.llama_cpp")
    lib = getattr(mod, "_lib", None)
    name = getattr(lib, "_name", None)
    return Path(name).resolve() if name else None


def ensure_llama_cpp():
    """Import llama_cpp bound to our libllama and return the module."""
    ours = (lib_dir() / LIBLLAMA).resolve()
    if "llama_cpp.llama_cpp" not in sys.modules:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(ours.parent)
    import llama_cpp  # noqa: PLC0415 (must follow the environment change)

    loaded = _loaded_by_llama_cpp()
    others = [p for p in _mapped_libllama() if p != ours]
    if (loaded is not None and loaded != ours) or others:
        raise LibraryMismatchError(
            f"llama_cpp is bound to {loaded or others[0]}, not to EntroKV Edge's patched library {ours}. "
            "Import entrokv_edge before llama_cpp (or start a new Python process), and do not point "
            "LLAMA_CPP_LIB_PATH elsewhere."
        )
    return llama_cpp
