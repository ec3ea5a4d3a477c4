"""Soak: a long chat through a small F32 cache, every eviction checked against the state-rewrite
oracle, and the process's memory along the way.

    python benchmarks/soak.py [--model smollm2-135m] [--turns 12] [--answer 320] [--cells 1024]

Each turn appends a piece of an essay and a question to the conversation (EntroKVLlama.eval: in
pieces, with evictions, when it does not fit) and decodes `answer` tokens greedily, one at a time,
the cache evicted whenever it fills. At every eviction the oracle rebuilds the expected cache on
its own: the cache's state (llama_state_seq_get_data) taken just before the eviction is rewritten
in Python (tests/helpers.oracle_blob), keeping per (layer, KV head) the cells that hold the true
positions the controller chose. Which cell holds which true position comes from a table this script
keeps itself (positions in order; at each eviction the compacted cells' synthetic positions stand
for the kept ones), not from the native code. The evicted cache must equal that blob byte for byte,
the native true-position table must equal the script's, and the next evaluation (the first one
after the eviction, whatever it is: a prompt piece or a decoded token) must give the same logits
here and in a second context loaded with the blob. RSS (VmRSS) is read after every turn; its slope
after the warm-up turns must be about flat. Prints a summary and writes benchmarks/results/soak.json.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import entrokv_edge as ek  # noqa: E402  (binds llama_cpp to the patched library first)
from llama_cpp import llama_cpp as C  # noqa: E402

from helpers import oracle_blob, parse_cache, state_blob  # noqa: E402

QUESTIONS = ["What is the main point of this passage?", "Who is mentioned in it, and why?",
             "Which example does the author give?", "What would the author advise a beginner?",
             "Summarize the last paragraph in one sentence."]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def malloc_mib() -> float:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2: heap in use + mmapped
    blocks), in MiB: what a leak grows, whatever the allocator keeps as free pages (RSS); NaN
    without glibc >= 2.33."""
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return float("nan")
    f.restype = _Mallinfo2
    m = f()
    return (m.uordblks + m.hblkhd) / 2**20


def logits(llm) -> np.ndarray:
    return np.ctypeslib.as_array(C.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()


class Mirror:
    """The true position each cell holds per slot, kept here: cells hold their own (synthetic)
    positions, except the cells of the last compaction, whose synthetic positions p_lo.. stand for
    the positions it kept."""

    def __init__(self):
        self.kept: np.ndarray | None = None     # [n_slots, K]
        self.p_lo = 0

    def table(self, pos: np.ndarray, n_slots: int) -> np.ndarray:
        """[n_slots, n_cells]: the true positions of a blob's cells (pos: their synthetic positions)."""
        out = np.broadcast_to(pos, (n_slots, pos.size)).copy()
        if self.kept is not None:
            K = self.kept.shape[1]
            hit = (pos >= self.p_lo) & (pos < self.p_lo + K)
            out[:, hit] = self.kept[:, pos[hit] - self.p_lo]
        return out

    def evicted(self, kept: np.ndarray, n_logical: int) -> None:
        self.kept, self.p_lo = kept, n_logical - kept.shape[1]


class _Probe(ek.llama_cpp.Llama):
    """Between EntroKVLlama and llama_cpp.Llama in SoakLlama's MRO: every evaluation EntroKVLlama
    makes (its super().eval) passes here, so the first one after an eviction is replayed on the oracle."""

    def eval(self, tokens):
        n_past = self.n_tokens
        super().eval(tokens)
        if self.pending is not None:
            self.compare(list(tokens), n_past)


class SoakLlama(ek.EntroKVLlama, _Probe):
    """An EntroKVLlama whose every eviction is checked against the state-rewrite oracle, evaluated in
    `oracle` (a plain llama_cpp.Llama of the same model and cache)."""

    def __init__(self, path: str, oracle, **kw):
        super().__init__(path, **kw)
        self.oracle, self.mirror, self.pending = oracle, Mirror(), None
        self.checks: list[dict] = []
        self._before = None
        self.events.listen("evicting", self._evicting)
        self.events.listen("evicted", self._evicted)

    def _evicting(self, rt, controller, scores, aside) -> None:
        before = state_blob(self)
        pos = parse_cache(before).pos
        geo = ek.geometry(self)
        self._before = (before, pos, geo, self.mirror.table(pos, geo.n_slots))

    def _evicted(self, rt, controller, result) -> None:
        before, pos, geo, table = self._before
        kept = result.positions.reshape(geo.n_slots, -1)
        sel = np.stack([np.searchsorted(row, k) for row, k in zip(table, kept)])
        assert np.array_equal(np.take_along_axis(table, sel, 1), kept), "a kept position the cache did not hold"
        want = oracle_blob(before, geo, sel.astype(np.int32))
        self.checks.append({"n_tokens": self.n_tokens, "kept": int(kept.shape[1]), "cells_before": int(pos.size),
                            "blob_equal": state_blob(self) == want,
                            "table_equal": bool(np.array_equal(ek.true_positions(self)[:, : kept.shape[1]], kept))})
        self.mirror.evicted(kept, self.n_tokens)
        self.pending = want

    def compare(self, tokens: list[int], n_past: int) -> None:
        """Load the oracle's blob into the second context, evaluate the same tokens there (the same
        batches), and record the largest logit difference."""
        blob, self.pending = self.pending, None
        o = self.oracle
        C.llama_memory_clear(o._ctx.memory, True)
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        assert C.llama_state_seq_set_data(o.ctx, buf, len(blob), 0) == len(blob), "the oracle's blob was refused"
        for i in range(0, len(tokens), self.n_batch):
            o._batch.set_batch(batch=tokens[i: i + self.n_batch], n_past=n_past + i, logits_all=False)
            o._ctx.decode(o._batch)
        self.checks[-1].update(tokens_after=len(tokens),
                               max_logit_diff=float(np.abs(logits(self) - logits(o)).max()))


def make(path: str, cells: int, threads: int, type_k: int = 0, type_v: int = 0, flash_attn: bool = False,
         **settings) -> SoakLlama:
    """The soak's context and its oracle: F32 K and V (or the cache types given: the oracle holds the same bytes,
    so its logits are the runtime's, bit for bit), one batch size, the same threads. The oracle rewrites
    the cells an eviction keeps, so ``reselect`` is off by default here: a reselect also brings back rows an
    earlier eviction set aside, which tests/test_reselect.py checks against the stored rows instead."""
    common = dict(n_ctx=cells, n_batch=512, n_ubatch=512, type_k=type_k, type_v=type_v, flash_attn=flash_attn,
                  n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    oracle = ek.llama_cpp.Llama(path, **common)
    return SoakLlama(path, oracle, **common, **{"reselect": False, **settings})


def greedy_token(lg: np.ndarray, stop: set) -> int:
    """The most likely token that does not end the answer (the soak decodes a fixed length)."""
    if stop:
        lg = lg.copy()
        lg[list(stop)] = -np.inf
    return int(np.argmax(lg))


def soak(llm: SoakLlama, turns: list[list[int]], answer: int, stop: set = frozenset(), warmup: int = 3) -> dict:
    """Run the turns (token lists: a document piece and a question each), `answer` decoded tokens
    after each; returns the figures."""
    rss, heap, decoded, t0 = [], [], 0, time.perf_counter()
    for turn in turns:
        llm.eval(turn)
        for _ in range(answer):
            llm.eval([greedy_token(logits(llm), stop)])
            decoded += 1
        gc.collect()                                # what is still reachable, not what waits for the collector
        rss.append(rss_mib())
        heap.append(malloc_mib())
    if llm.pending is not None:                     # an eviction at the very end: one more token checks it
        llm.eval([greedy_token(logits(llm), stop)])
        decoded += 1
    return summary(llm, turns, decoded, rss, heap, warmup, time.perf_counter() - t0)


def slope(values: list[float], warmup: int) -> float:
    """Least-squares slope per turn of values after the warm-up turns."""
    after = values[warmup:] if len(values) > warmup + 1 else values
    return float(np.polyfit(np.arange(len(after)), after, 1)[0]) if len(after) > 1 else 0.0


def summary(llm: SoakLlama, turns, decoded: int, rss: list[float], heap: list[float], warmup: int,
            secs: float) -> dict:
    checks = llm.checks
    return {"turns": len(turns), "prompt_tokens": sum(map(len, turns)), "decoded_tokens": decoded,
            "logical_tokens": llm.n_tokens, "kv_cells": llm.kv_cells, "evictions": llm.stats.evictions,
            "checked": sum("max_logit_diff" in c for c in checks),
            "blob_equal": sum(c["blob_equal"] for c in checks), "table_equal": sum(c["table_equal"] for c in checks),
            "max_logit_diff": max((c.get("max_logit_diff", 0.0) for c in checks), default=0.0),
            "rss_mib": [round(r, 1) for r in rss], "rss_first": round(rss[0], 1), "rss_last": round(rss[-1], 1),
            "rss_slope_mib_per_turn": round(slope(rss, warmup), 3), "malloc_mib": [round(h, 2) for h in heap],
            "malloc_slope_mib_per_turn": round(slope(heap, warmup), 3), "warmup_turns": warmup,
            "seconds": round(secs, 1),
            "checks": checks}


def essay_turns(llm, n_turns: int, piece: int) -> list[list[int]]:
    """n_turns token lists: the next `piece` tokens of the essays, then a question."""
    import _harness as H
    text = "\n\n".join(p.read_text() for p in H.essays()[:12])
    toks = llm.tokenize(text.encode(), add_bos=False)
    out = []
    for i in range(n_turns):
        q = llm.tokenize(f"\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:".encode(), add_bos=False)
        out.append(([llm.token_bos()] if i == 0 else []) + toks[i * piece: (i + 1) * piece] + q)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--piece", type=int, default=240, help="essay tokens per turn")
    ap.add_argument("--answer", type=int, default=320, help="decoded tokens per turn")
    ap.add_argument("--cells", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    args = ap.parse_args()
    import _harness as H
    llm = make(str(ek.models.model_path(args.model)), args.cells, args.threads)
    res = soak(llm, essay_turns(llm, args.turns, args.piece), args.answer, H.stop_tokens(llm))
    res.update(model=args.model, policy=llm.config.policy, budget=llm.config.budget)
    print(f"{res['turns']} turns, {res['prompt_tokens']} prompt + {res['decoded_tokens']} decoded tokens "
          f"({res['logical_tokens']} logical) through {res['kv_cells']} cells in {res['seconds']:.0f} s")
    print(f"{res['evictions']} evictions, {res['checked']} checked against the oracle: state equal in "
          f"{res['blob_equal']}, true positions equal in {res['table_equal']}, "
          f"max |logit diff| {res['max_logit_diff']:.3g}")
    print(f"RSS {res['rss_first']:.1f} MiB after turn 1, {res['rss_last']:.1f} after the last; "
          f"slope after {res['warmup_turns']} warm-up turns {res['rss_slope_mib_per_turn']:+.3f} MiB/turn "
          f"(malloc in use {res['malloc_mib'][0]:.1f} -> {res['malloc_mib'][-1]:.1f} MiB, "
          f"{res['malloc_slope_mib_per_turn']:+.3f} MiB/turn)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    ok = res["checked"] == res["blob_equal"] == res["table_equal"] == res["evictions"] and res["max_logit_diff"] <= 1e-5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
