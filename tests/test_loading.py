"""The package binds llama-cpp-python to the patched libllama and reports the cache geometry."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import entrokv_edge as ek
from entrokv_edge._paths import LIBLLAMA, lib_dir
from helpers import feed, make_llm


def run_py(code, env=None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_llama_cpp_loads_our_library():
    import llama_cpp
    from entrokv_edge._loader import _mapped_libllama
    assert os.path.samefile(llama_cpp.llama_cpp._lib._name, lib_dir() / LIBLLAMA)
    assert _mapped_libllama() == [(lib_dir() / LIBLLAMA).resolve()]
    assert ek.llama_cpp is llama_cpp


def test_import_after_llama_cpp_on_another_library_is_refused(tmp_path):
    other = tmp_path / "otherlib"
    shutil.copytree(lib_dir(), other)
    r = run_py("""
        import llama_cpp
        try:
            import entrokv_edge
        except ImportError as e:
            print(type(e).__name__, e)
        else:
            print("imported")
    """, env={"LLAMA_CPP_LIB_PATH": str(other)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("LibraryMismatchError") and "Import entrokv_edge before llama_cpp" in r.stdout


def test_import_after_llama_cpp_on_our_library_is_fine():
    r = run_py("""
        import llama_cpp, entrokv_edge
        print("ok")
    """, env={"LLAMA_CPP_LIB_PATH": str(lib_dir())})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("type_k,type_v,fa,bytes_per_head", [
    ("f16", "f16", False, (64, 64)), ("f32", "f32", True, (128, 128)),
    ("q8_0", "q8_0", True, (34, 34)), ("q4_0", "q4_0", True, (18, 18)), ("q4_0", "f16", False, (18, 64)),
])
@pytest.mark.parametrize("model,n_kv", [("llama-r1", 6), ("llama-r3", 2), ("llama-r6", 1)])
def test_geometry(synth_models, model, n_kv, type_k, type_v, fa, bytes_per_head):
    llm = make_llm(synth_models[model], n_ctx=256, type_k=type_k, type_v=type_v, flash_attn=fa)
    g = ek.geometry(llm)
    assert (g.n_layers, g.n_slots, g.kv_size, g.n_used, g.pos_max) == (2, 2 * n_kv, 256, 0, -1)
    assert (g.type_k, g.type_v, g.v_trans, g.is_iswa, g.host_buffers) == (type_k, type_v, not fa, False, True)
    assert [l.il for l in g.layers] == [0, 1] and [l.slot0 for l in g.layers] == [0, n_kv]
    for l in g.layers:
        assert (l.n_head_kv, l.head_dim_k, l.head_dim_v) == (n_kv, 32, 32)
        assert (l.k_bytes_per_cell, l.v_bytes_per_cell) == (n_kv * bytes_per_head[0], n_kv * bytes_per_head[1])
    feed(llm, range(3, 33))
    g = ek.geometry(llm)
    assert (g.n_used, g.pos_max, g.n_compacted) == (30, 29, 0)
    assert list(g.slot_layers()) == [0] * n_kv + [1] * n_kv
