"""The fuzz tests (tests/test_fuzz.py) at length: the same strategies and checks
(tests/fuzzing.py, fuzz_scores.py, fuzz_inputs.py), many more examples, new random ones on every run.

    python benchmarks/fuzz.py [--examples 1000] [--parts compact selector ...] [--derandomize]

Parts: compact (random keep lists), restore (random true-position tables), selector (random
scores and parameters for the C selector), observer (random windows, toggles and decodes),
damaged (random damage to a session file), resigned (well-formed session files whose content
does not fit), cli (random command lines, in-process). Every input either gets the reference's result or the documented refusal with the
cache unchanged; a failure stops the run with hypothesis' minimal example. Prints the inputs
tried and their outcomes (accepted, refusals by kind) per part, and writes
benchmarks/results/fuzz.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import entrokv_edge  # noqa: E402,F401  (binds llama_cpp to the patched library first)

import fuzz_inputs as FI  # noqa: E402
import fuzz_scores as FS  # noqa: E402
import fuzzing as F  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from synth import write_model  # noqa: E402

PARTS = ("compact", "restore", "selector", "observer", "damaged", "resigned", "cli")


def _part(name: str, tmp: Path):
    """(strategy, check) of one part, with its targets built in tmp."""
    if name in ("compact", "restore"):
        t = F.Target(write_model(tmp / "llama-r3.gguf", n_head=6, n_head_kv=2, seed=3))
        if name == "restore":
            return F.restore_tables(t.geo.n_slots), lambda tp: F.check_restore(t, tp)
        return F.keep_lists(t.geo.n_slots, t.geo.kv_size), lambda *c: F.check_compact(t, *c)
    if name == "selector":
        return FS.selector_cases(), FS.check_selector
    if name == "observer":
        t = FS.ObserverTarget(write_model(tmp / "qwen2-r2.gguf", arch="qwen2", n_head=6, n_head_kv=3, seed=2),
                             n_ctx=256)
        return FS.observer_ops(), lambda *c: FS.check_observer(t, *c)
    if name in ("damaged", "resigned"):
        t = FI.SessionTarget(write_model(tmp / f"{name}.gguf", n_head=6, n_head_kv=2, seed=3), tmp)
        if name == "damaged":
            return FI.damaged_files(t.data, t.marks), lambda *c: FI.check_damaged(t, *c)
        return st.tuples(st.sampled_from(FI.RESIGNED), st.integers(0, 2**32 - 1)), lambda *c: FI.check_resigned(t, *c)
    t = FI.CLIFiles(tmp)
    return FI.cli_args(t), FI.check_cli


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000, help="inputs per part")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--derandomize", action="store_true", help="the same inputs on every run")
    ap.add_argument("--out", default=str(HERE / "results" / "fuzz.json"))
    args = ap.parse_args()
    results = {}
    for name in args.parts:
        with tempfile.TemporaryDirectory() as d:
            strategy, check = _part(name, Path(d))
            t0 = time.perf_counter()
            kinds = F.explore(strategy, check, args.examples, derandomize=args.derandomize)
            secs = time.perf_counter() - t0
        n = sum(kinds.values())
        accepted = sum(v for k, v in kinds.items() if k == "ok" or k.endswith(": loaded"))
        results[name] = {"inputs": n, "accepted": accepted, "seconds": round(secs, 1),
                         "outcomes": dict(kinds.most_common())}
        print(f"{name}: {n} inputs in {secs:.0f} s, no failure")
        for k, v in kinds.most_common():
            print(f"    {v:6d}  {k}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"examples": args.examples, "derandomize": args.derandomize,
                                          "parts": results}, indent=1) + "\n")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
