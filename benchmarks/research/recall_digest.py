"""Issue 23, stage 1: how well a page digest ranks a store's pages, measured without the model.

    python benchmarks/research/recall_digest.py [--models smollm2-135m] [--split tune]
        [--cache DIR] [--out benchmarks/research/results/recall_digest.json]   (a rerun replaces its models' rows)

recall_bound.py found that recall driven by the min/max digest stays far from the bound (the
queries' exact attention). This script isolates the ranking. The prompts, the eviction to 20%
and the teacher-forced answer are recall_bound.py's; the queries and keys are captured once per
prompt. Each recall event (the new turn's observed window, then every ``k`` answer tokens) and
each (layer, KV head) gives every page of the store (the evicted tokens, in pages of ``page``
by true position) an exact score: the queries' attention over every key on the page's evicted
tokens, summed over the queries, the max over the group's query heads (recall_bound's "exact").
A digest ranks the same pages; its **capture** at M pages is the exact score of its top M pages
over that of the exact top M (1.0: the digest picks what the bound would). Means over events
and slots, per prompt; the digest's size per page is given in key rows (a 16-token page of keys
is 16).

The digests (q: a query head's vector after RoPE; mu, lo, hi: the mean, min and max of the
page's evicted keys per channel):
  minmax     Quest: sum_c max(q_c lo_c, q_c hi_c), an upper bound of q.k (2 rows)
  centroid   q.mu, an estimate, not a bound (1 row)
  ball       q.mu + |q| R, R the largest distance of a key to mu: a bound (1 row + 1 number)
  reps2      max of q.k over the page's 2 keys that the eviction's observed window attended
             most (the document's last ``window`` queries, max over the group's heads): the
             keys a page is likely to be read for (2 rows)
  sparq16    SparQ's approximation: q.k over the 16 channels where |q| is largest, the max over
             the page's keys; it reads a quarter of every key, not a digest (4 rows per 16)
Each page's score for a query head is turned into attention mass as recall_bound's digest does
(count x exp(score - lse over the resident keys), at most 1), summed over the queries, the max
over the group's heads.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import entrokv_edge as ek  # noqa: E402

import _harness as H  # noqa: E402
import recall_bound as RB  # noqa: E402

DIGESTS = ("minmax", "centroid", "ball", "reps2", "sparq16")
G = dict(RB.FULL, split="tune", k=4, page=16, ms=[4, 16])


def capture_prompt(llm, model: str, p: H.Prompt, g: dict) -> dict:
    """The arrays one prompt needs: q, k per layer, the resident set after the eviction, n, s."""
    snap = H.prefill(llm, p)["after"]
    n, s = len(p.prefix), len(p.suffix)
    H.restore(llm, snap)
    llm.eval(p.suffix)
    ref = H.greedy(llm, H.logits(llm), g["tokens"], H.stop_tokens(llm)) or [0]
    H.evict_from(llm, snap, ek.EvictionConfig(budget=g["budget"]))
    geo = ek.geometry(llm)
    resident = np.sort(ek.true_positions(llm)[:, : geo.n_used], axis=1)
    q, k = RB.capture(model, p.prefix + p.suffix + ref[:-1])
    return {"q": q, "k": k, "resident": resident, "n": n, "s": s, "T": len(ref),
            "slot_layer": geo.slot_layers(), "slot_head": geo.slot_heads()}


def digest_scores(name: str, q: np.ndarray, km: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                  reps: np.ndarray, scale: float) -> np.ndarray:
    """[I, r, P] scores (logit units) of the store's pages for queries q [I, r, d]; km the evicted
    keys in position order (page runs at ``starts``), ``reps`` [P, 2] each page's two keys the
    eviction's window attended most (indices into km)."""
    if name in ("minmax", "centroid"):
        return RB.page_logits(name, q, km, starts, counts, scale)
    if name == "ball":
        mu = np.add.reduceat(km, starts, axis=0) / counts[:, None]
        page_of = np.repeat(np.arange(starts.size), counts)
        rad = np.zeros(starts.size)
        np.maximum.at(rad, page_of, np.linalg.norm(km - mu[page_of], axis=1))
        return (np.einsum("ird,pd->irp", q, mu) + np.linalg.norm(q, axis=-1)[:, :, None] * rad) * scale
    if name == "reps2":
        return np.einsum("ird,pjd->irpj", q, km[reps]).max(-1) * scale
    if name == "sparq16":
        idx = np.argsort(-np.abs(q), axis=-1)[..., :16]                                  # [I, r, 16]
        qs = np.take_along_axis(q, idx, -1)
        ks = km[:, idx].transpose(1, 2, 0, 3)                                             # [I, r, M, 16]
        tok = np.einsum("irc,irmc->irm", qs, ks) * scale
        return np.maximum.reduceat(tok, starts, axis=-1)
    raise ValueError(name)


def capture_ratios(a: dict, window: int, k: int, page: int, ms: list[int]) -> dict:
    """{digest: {M: mean capture}} over the recall events and slots of one prompt."""
    q, kd, res0, n, s, T = a["q"], a["k"], a["resident"], a["n"], a["s"], a["T"]
    il0 = next(iter(kd))
    r = q[il0].shape[1] // kd[il0].shape[1]
    scale = 1.0 / math.sqrt(kd[il0].shape[2])
    events = [n + np.arange(max(0, s - window), s)] + [n + s - 1 + np.arange(t0 - k, t0) for t0 in range(k, T, k)]
    obs_q = np.arange(n - window, n)
    acc = {d: {m: [] for m in ms} for d in DIGESTS}
    for sl in range(len(res0)):
        il, g = int(a["slot_layer"][sl]), int(a["slot_head"][sl])
        kk = kd[il][:, g].astype(np.float64)
        res = np.zeros(n, dtype=bool)
        res[res0[sl]] = True
        missing = np.flatnonzero(~res)
        if missing.size == 0:
            continue
        starts, counts = RB.page_runs(missing, page)
        km = kk[missing]
        qo = q[il][obs_q][:, g * r:(g + 1) * r].astype(np.float64)
        lo = np.einsum("ird,td->irt", qo, kk[:n]) * scale
        lo = np.where(np.arange(n)[None, None, :] <= obs_q[:, None, None], lo, -np.inf)
        ob = np.exp(lo - RB._lse(lo)[:, :, None]).sum(0).max(0)[missing]                # the eviction's view
        reps = np.array([[a + j for j in np.argsort(-ob[a:a + c], kind="stable")[:2]] * (2 // min(c, 2))
                         for a, c in zip(starts, counts)])                                # [P, 2]
        for ev in events:
            qq = q[il][ev][:, g * r:(g + 1) * r].astype(np.float64)                     # [I, r, d]
            top = int(ev.max()) + 1
            logits = np.einsum("ird,td->irt", qq, kk[:top]) * scale
            logits = np.where(np.arange(top)[None, None, :] <= ev[:, None, None], logits, -np.inf)
            p_all = np.exp(logits[:, :, missing] - RB._lse(logits)[:, :, None])
            exact = np.add.reduceat(p_all, starts, axis=-1).sum(0).max(0)                # [P]
            best = {m: np.sort(exact)[::-1][:m].sum() for m in ms}
            held = np.concatenate([res, np.ones(top - n, dtype=bool)])
            lse_res = RB._lse(np.where(held[None, None, :], logits, -np.inf))            # [I, r]
            for d in DIGESTS:
                score = RB.page_mass(digest_scores(d, qq, km, starts, counts, reps, scale), counts, lse_res)
                for m in ms:
                    if best[m] > 0:
                        acc[d][m].append(exact[np.argsort(-score, kind="stable")[:m]].sum() / best[m])
    return {d: {m: float(np.mean(v)) for m, v in acc[d].items()} for d in DIGESTS}


def main(argv=None) -> int:
    import evidence
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--split", choices=RB.SPLITS, default=G["split"])
    ap.add_argument("--cache", help="keep each prompt's captured arrays here (npz) and reuse them")
    ap.add_argument("--out", default=str(HERE / "results" / "recall_digest.json"))
    args = ap.parse_args(argv)
    g = dict(G, split=args.split)
    commit, t0 = evidence.commit_id(), time.perf_counter()
    rows = []
    for model in args.models:
        llm = H.load(model, g["length"] + g["tokens"] + 256)
        edge = ek.EvictionConfig(budget=g["budget"])
        for p in RB.prompts(llm, g):
            f = Path(args.cache) / f"{model}-{p.meta['split']}-{p.meta['source']}.npz" if args.cache else None
            if f is not None and f.exists():
                z = np.load(f)
                a = {key: z[key] for key in ("resident", "slot_layer", "slot_head")}
                a.update({key: int(z[key]) for key in ("n", "s", "T")})
                a["q"] = {int(x[2:]): z[x] for x in z.files if x.startswith("q_")}
                a["k"] = {int(x[2:]): z[x] for x in z.files if x.startswith("k_")}
            else:
                a = capture_prompt(llm, model, p, g)
                if f is not None:
                    f.parent.mkdir(parents=True, exist_ok=True)
                    np.savez(f, resident=a["resident"], slot_layer=a["slot_layer"], slot_head=a["slot_head"],
                             n=a["n"], s=a["s"], T=a["T"], **{f"q_{i}": v for i, v in a["q"].items()},
                             **{f"k_{i}": v for i, v in a["k"].items()})
            cr = capture_ratios(a, edge.window, g["k"], g["page"], g["ms"])
            rows.append({"model": model, "split": p.meta["split"], "source": p.meta["source"],
                         "capture": {d: {str(m): x for m, x in v.items()} for d, v in cr.items()}})
            print(p.meta["source"], " ".join(f"{d} {cr[d][4]:.2f}/{cr[d][16]:.2f}" for d in DIGESTS), flush=True)
        llm.close()
    out = Path(args.out)
    runs = []
    if out.exists():                  # a rerun replaces the rows of the models and split it ran
        old = json.loads(out.read_text())
        ran = {(r["model"], r["split"], r["source"]) for r in rows}
        rows = [r for r in old["data"]["rows"] if (r["model"], r["split"], r["source"]) not in ran] + rows
        runs = old["meta"].get("runs", [old["meta"]])
    summ = summary(rows)
    for key, s in summ.items():
        for d, v in s.items():
            print(f"{key:28} {d:9} " + " ".join(f"M={m}: {x:.3f}" for m, x in v.items()))
    meta = {"runs": runs + [evidence.meta("full", g, time.perf_counter() - t0, commit)]}
    out.write_text(json.dumps({"meta": meta, "data": {"rows": rows, "summary": summ}}, indent=1))
    return 0


def summary(rows: list[dict]) -> dict:
    """{"model split": {digest: {M: mean capture over the prompts}}}."""
    out = {}
    for model, split in sorted({(r["model"], r["split"]) for r in rows}):
        rs = [r for r in rows if (r["model"], r["split"]) == (model, split)]
        out[f"{model} {split}"] = {d: {m: float(np.mean([r["capture"][d][m] for r in rs])) for m in rs[0]["capture"][d]}
                                   for d in DIGESTS}
    return out


if __name__ == "__main__":
    sys.exit(main())
