"""Round 4's question, on long_prompt.py's needles: should the turn's recall run after a prompt that
ends in its own eviction (scored with the lookahead draft)? Runs long_prompt.py's ``needle`` part with
one more configuration, "guided+recall-noend": recall on, but no recall right after that final
eviction (the behaviour before commit 7f6ad00, when the draft's scores dropped the window's queries:
reproduced here by dropping them again, in this process only). "guided+recall" is today's code.

    python benchmarks/research/end_recall_ab.py [long_prompt.py's arguments]
    python benchmarks/research/end_recall_ab.py --recall-parts [benchmarks/recall.py's arguments]

With ``--recall-parts`` it runs benchmarks/recall.py's follow-up and fidelity parts instead, where the
document is a prompt that ends in its own eviction and the question comes after it; their ``--configs``
may then name "recall-noend" (the defaults without that recall). Not the decode part, whose configurations
run interleaved in one process.

The rule (written before the rows; long_prompt.py's docstring, round 4). With ``--parts fidelity-tune``
every recall configuration runs both ways, the rows without that recall named "...-noend".
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import long_prompt as LP  # noqa: E402
from entrokv_edge.controller import controller as C  # noqa: E402

_draft = C.lookahead_scores
_NOEND = {"on": False}


def _noend(llm, scores, *args, **kwargs):
    out = _draft(llm, scores, *args, **kwargs)
    if _NOEND["on"] and out is not scores:      # a draft joined: its mix without the window's queries, as before
        out = dataclasses.replace(out, queries=None)
    return out


C.lookahead_scores = _noend
LP.CONFIGS["guided+recall-noend"] = dict(recall=True)


_rows = LP.needle_rows


def needle_rows(models, split, lengths, cells, configs, *args, **kwargs):
    rows = []
    for name, kw in configs.items():
        _NOEND["on"] = name == "guided+recall-noend"
        rows += [r for r in _rows(models, split, lengths, cells, {name: kw}, *args, **kwargs)
                 if r["config"] != "full" or name == next(iter(configs))]
    _NOEND["on"] = False
    return rows


LP.needle_rows = needle_rows

_fid = LP.fidelity_rows


def fidelity_rows(models, *args, configs=(), **kwargs):
    """Each recall configuration's rows with the recall after the final eviction (as today) and without it
    (the same names with "-noend"; "one eviction+recall" too)."""
    rows = []
    for noend in (False, True):
        _NOEND["on"] = noend
        todo = [c for c in configs if c != "guided+recall-noend" and (not noend or LP.CONFIGS[c].get("recall"))]
        if not todo:
            continue
        got = _fid(models, *args, configs=todo, **kwargs)
        for r in got:
            if noend:
                if r["config"] in ("one eviction", "not run"):
                    continue
                r["config"] += "-noend"
            rows.append(r)
    _NOEND["on"] = False
    return rows


LP.fidelity_rows = fidelity_rows


def recall_main(argv) -> int:
    """benchmarks/recall.py with "recall-noend" (its fidelity and follow-up parts run it without the recall
    after a prompt's own final eviction)."""
    if any(a == "decode" or a.startswith("decode,") or ",decode" in a for a in argv):
        raise SystemExit("end_recall_ab.py --recall-parts: the decode part interleaves its configurations in one "
                         "process; run it with benchmarks/recall.py")
    import recall as R
    R.CONFIGS["recall-noend"] = True
    for name in ("fidelity_rows", "followup_rows"):
        def run(*args, _f=getattr(R, name)):
            *head, configs = args           # both are called with the configurations last
            rows = []
            for i, c in enumerate(configs):     # one at a time; the reference rows ("full", ...) from the first
                _NOEND["on"] = c == "recall-noend"
                rows += [r for r in _f(*head, [c]) if i == 0 or r["config"] == c]
            _NOEND["on"] = False
            return rows
        setattr(R, name, run)
    return R.main(argv)


if __name__ == "__main__":
    if "--recall-parts" in sys.argv:
        sys.exit(recall_main([a for a in sys.argv[1:] if a != "--recall-parts"]))
    sys.exit(LP.main())
