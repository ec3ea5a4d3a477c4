"""Client half of tests/test_rpc.py, run in its own process.

ggml aborts a process whose registered RPC server goes away, so the test process never
registers one: this script does, runs the same work on the CPU and with layers on the
RPC server, and writes every result to an .npz for the test to compare.

    python tests/rpc_client.py ENDPOINT MODEL OUT.npz
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import entrokv_edge  # noqa: E402,F401  (binds llama_cpp to the patched library first)
from entrokv_edge import EntroKVLlama, Observation, compact, geometry, true_positions, value_norms  # noqa: E402
from entrokv_edge.bindings import read_cells, rows_to_float, write_cells  # noqa: E402
from entrokv_edge.runtime.rpc import add_servers  # noqa: E402
from helpers import feed, make_llm, random_keep  # noqa: E402

# where the layers live: none offloaded, all of them (and the output), the last half
PLACEMENTS = {"cpu": 0, "rpc": -1, "split": 15}
CACHES = {"f32": dict(type_k="f32", flash_attn=False),   # V stored transposed
          "f16fa": dict(type_k="f16", flash_attn=True)}  # V stored as rows
TEXT = (b"Alice keeps her spare key under the blue flower pot by the back door. "
        b"The garden has roses, tulips and a small pond with three goldfish. ") * 6
LONG = b"".join(b"Line %d: the value of register %d is %d. " % (i, i % 7, (i * 37) % 101) for i in range(60))


def main(endpoint: str, model: str, out: str) -> None:
    devices = add_servers(endpoint)
    res = {"devices": np.array(devices)}
    for cname, ckw in CACHES.items():
        for pname, ngl in PLACEMENTS.items():
            llm = make_llm(model, n_ctx=512, n_gpu_layers=ngl, **ckw)
            toks = llm.tokenize(TEXT)
            llm.eval(toks[:-32])
            with Observation(llm, 32) as obs:
                llm.eval(toks[-32:])
            g = geometry(llm)
            # a different random keep per (layer, KV head): exercises the per-head gather
            keep = random_keep(np.random.default_rng(7), g.n_slots, len(toks), len(toks) // 3, protect=8)
            compact(llm, keep)
            res[f"{cname}/{pname}/scores"] = obs.last.scores
            res[f"{cname}/{pname}/norms"] = value_norms(llm)       # read back from the RPC buffers
            # rows read out of the RPC buffers, then written back exchanged (cells 8..15 <-> 16..23 of every slot)
            a, b = np.arange(8, 16), np.arange(16, 24)
            k, v = read_cells(llm, [np.concatenate([a, b])] * g.n_slots)
            res[f"{cname}/{pname}/rows_k"] = np.stack([rows_to_float(x, g.type_k) for x in k])
            res[f"{cname}/{pname}/rows_v"] = np.stack([rows_to_float(x, g.type_v) for x in v])
            tp = true_positions(llm)
            write_cells(llm, [np.concatenate([b, a])] * g.n_slots, [tp[s][np.concatenate([a, b])] for s in range(g.n_slots)],
                        k, v)
            res[f"{cname}/{pname}/true_pos_written"] = true_positions(llm)[:, :32]
            res[f"{cname}/{pname}/logits"] = feed(llm, llm.tokenize(b" Where is the key?", add_bos=False))
            llm.close()
    for pname in ("cpu", "split"):
        # a prompt 3x the cache: chunked prefill, evictions between chunks, then greedy decoding
        llm = EntroKVLlama(model, n_ctx=256, n_batch=256, n_ubatch=256, n_gpu_layers=PLACEMENTS[pname],
                           type_k=0, flash_attn=False, budget=96, verbose=False, seed=0,
                           n_threads=2, n_threads_batch=2)
        out_toks = []
        for t in llm.generate(llm.tokenize(LONG + b" Line 3: the value of register"), temp=0.0):
            out_toks.append(t)
            if len(out_toks) == 12:
                break
        res[f"long/{pname}/tokens"] = np.array(out_toks)
        res[f"long/{pname}/n_prompt"] = np.array(len(llm.tokenize(LONG)))
        res[f"long/{pname}/evictions"] = np.array(llm.stats.evictions)
        llm.close()
    np.savez(out, **res)


if __name__ == "__main__":
    main(*sys.argv[1:4])
