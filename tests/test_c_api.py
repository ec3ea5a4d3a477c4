"""A C program uses the method with no Python: built against the installed header and
libllama, it prefills a synthetic model with the observer on, evicts with the C
Page-EntroKV selector and keeps decoding."""
import shutil
import subprocess

import pytest

from entrokv_edge._paths import include_dir, lib_dir

PROGRAM = r"""
#include "llama.h"
#include "llama-entrokv.h"
#include <stdio.h>

int main(int argc, char ** argv) {
    if (argc < 2) { return 64; }
    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!model || !ctx) { return 65; }

    enum { N = 120, W = 16 };
    llama_token toks[N];
    for (int i = 0; i < N; ++i) { toks[i] = 3 + (i * 37) % 290; }
    if (llama_decode(ctx, llama_batch_get_one(toks, N - W))) { return 66; }
    if (llama_entrokv_set_observer(ctx, W, NULL, NULL)) { return 67; }
    if (llama_decode(ctx, llama_batch_get_one(toks + N - W, W))) { return 68; }

    struct llama_entrokv_params p = llama_entrokv_default_params();
    p.budget = 48; p.page_size = 8; p.recent = W;
    const int kept = llama_entrokv_evict(ctx, 0, &p);
    if (kept < 0) { fprintf(stderr, "evict: %s\n", llama_entrokv_last_error()); return 69; }

    struct llama_entrokv_geometry g;
    llama_entrokv_get_geometry(ctx, &g);
    static float vn[1 << 16];
    if ((size_t) g.n_slots * g.kv_size > sizeof(vn) / sizeof(vn[0])) { return 71; }
    if (llama_entrokv_value_norms(ctx, vn, (size_t) g.n_slots * g.kv_size)) { return 72; }
    int n_norms = 0;   /* kept cells with a value: each slot's first `kept` cells */
    for (int s = 0; s < g.n_slots; ++s) {
        for (int c = 0; c < (int) g.kv_size; ++c) { n_norms += vn[(size_t) s * g.kv_size + c] > 0.0f; }
    }
    llama_token t = 5;
    for (int i = 0; i < 20; ++i) {
        if (llama_decode(ctx, llama_batch_get_one(&t, 1))) { return 70; }
    }
    struct llama_entrokv_geometry g2;
    llama_entrokv_get_geometry(ctx, &g2);
    float sc[64] = {0};
    int32_t out[64];
    p.budget = 4;   /* 0 pages of 8: below the protected pages, refused */
    const int bad = llama_entrokv_select_pages(sc, 1, 1, 1, 64, &p, out, 64);
    printf("kept %d used %u compactions %d pos_max %d after %d bad %d norms %d slots %d\n",
           kept, g.n_used, g.n_compactions, g.pos_max, g2.pos_max, bad, n_norms, g.n_slots);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
"""


def _build_and_run(tmp_path, program: str, model, timeout: int) -> subprocess.CompletedProcess:
    """Compile ``program`` against the installed header and libllama, run it on ``model``."""
    src, exe = tmp_path / "prog.c", tmp_path / "prog"
    src.write_text(program)
    subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-I", str(include_dir()), str(src), "-o", str(exe),
                    "-L", str(lib_dir()), "-lllama", f"-Wl,-rpath,{lib_dir()}"], check=True, capture_output=True)
    return subprocess.run([str(exe), str(model)], capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_c_program_evicts_with_page_entrokv(tmp_path, synth_models):
    r = _build_and_run(tmp_path, PROGRAM, synth_models["llama-r3"], 60)
    assert r.returncode == 0, r.stderr[-2000:]
    head, norms = r.stdout.strip().split(" norms ")
    assert head == "kept 48 used 48 compactions 1 pos_max 119 after 139 bad -5"  # 120 tokens = 15 pages of 8
    n_norms, n_slots = map(int, norms.split(" slots "))
    assert n_slots == 4 and n_norms == 48 * n_slots      # every kept cell of every slot has a value, the rest 0


SWA_PROGRAM = r"""
#include "llama.h"
#include "llama-entrokv.h"
#include <stdio.h>

int main(int argc, char ** argv) {
    if (argc < 2) { return 64; }
    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 1024;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!model || !ctx) { return 65; }
    enum { N = 700, W = 16 };
    llama_token toks[N];
    for (int i = 0; i < N; ++i) { toks[i] = 1000 + (i * 37) % 5000; }
    if (llama_decode(ctx, llama_batch_get_one(toks, N - W))) { return 66; }
    if (llama_entrokv_set_observer(ctx, W, NULL, NULL)) { return 67; }
    if (llama_decode(ctx, llama_batch_get_one(toks + N - W, W))) { return 68; }
    llama_memory_t mem = llama_get_memory(ctx);
    const int before = llama_memory_seq_pos_min(mem, 0);
    struct llama_entrokv_params p = llama_entrokv_default_params();
    p.budget = 128;
    const int kept = llama_entrokv_evict(ctx, 0, &p);
    if (kept < 0) { fprintf(stderr, "evict: %s\n", llama_entrokv_last_error()); return 69; }
    const int after = llama_memory_seq_pos_min(mem, 0);
    int32_t dropped = -1;
    const int again = llama_entrokv_swa_trim(ctx, 0, &dropped);
    llama_token t = 5;
    for (int i = 0; i < 8; ++i) {
        if (llama_decode(ctx, llama_batch_get_one(&t, 1))) { return 70; }
    }
    printf("kept %d swa min %d -> %d again %d dropped %d pos_max %d\n", kept, before, after, again, dropped,
           llama_memory_seq_pos_max(mem, 0));
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_c_program_evicts_gemma3_and_its_sliding_window_cache_is_trimmed(tmp_path, gemma3):
    """llama_entrokv_evict on a model with sliding-window layers also trims their cache: the
    sequence's first position there moves from 0 to the window's start (700 - 512)."""
    r = _build_and_run(tmp_path, SWA_PROGRAM, gemma3, 120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("kept ") and r.stdout.strip().split(" swa ")[1] == \
        "min 0 -> 188 again 0 dropped 0 pos_max 707"
