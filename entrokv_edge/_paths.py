"""Where the build put the patched libraries, headers and data of this package.

The native files are installed by CMake next to the Python sources in a regular
install, and beside them (another entry of ``entrokv_edge.__path__``) in an
editable one, so we search every package path entry.
"""
from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path


if sys.platform == "darwin":
    LIBLLAMA = "libllama.dylib"
elif sys.platform == "win32":
    LIBLLAMA = "llama.dll"
else:
    LIBLLAMA = "libllama.so"


def _roots() -> list[Path]:
    # the package's own search path (set before its __init__ runs, which imports this module)
    return [Path(p) for p in sys.modules[__package__].__path__]


@lru_cache(maxsize=None)
def native_file(relpath: str) -> Path:
    """Absolute path of an installed native file, e.g. ``lib/libllama.so``.

    Raises ImportError with the install command when the build output is missing.
    """
    for root in _roots():
        cand = root / relpath
        if cand.exists():
            return cand.resolve()
    raise ImportError(
        f"entrokv_edge: {relpath} is missing from {', '.join(map(str, _roots()))}; the patched "
        "llama.cpp was not built. Install the package with the README's command "
        "(it builds libllama with our patch series)."
    )


def lib_dir() -> Path:
    """Directory holding the patched libllama and its ggml libraries."""
    return native_file(f"lib/{LIBLLAMA}").parent


def include_dir() -> Path:
    """Directory holding llama-entrokv.h (our C API) and llama.h."""
    return native_file("include/llama-entrokv.h").parent
