"""An oracle for the questions SmolLM2 loses: the facts asked about pinned resident in every group buffer.

Each fact's sentence (recall.py's follow-up documents: all three facts; long_prompt.py's needle prompts: the
needle) is added to the pages every eviction keeps (a ``Protect`` wrapper around each runtime's policy,
controller/policies.py) from the moment it has been read, so every (layer, KV group) buffer holds it after every eviction, and
no recall swap displaces it (the recall's swaps spare protected pages too). The budget is unchanged: the
pinned pages take the place of other pages. With ``--pin facts+head`` the chat template's head (the tokens
before the document) is pinned too (needle prompts only).

If a question is still lost with its fact resident in every buffer, the fact's residency is not what loses
it; if it is won, the selection (eviction or recall) around the fact is what loses it.

    python benchmarks/research/pinned_oracle.py followup [recall.py's arguments]
    python benchmarks/research/pinned_oracle.py needle [--pin facts|facts+head] [long_prompt.py's arguments]

The pin holds for every runtime of the process, so ``--configs`` must name pinned configurations only (the
full cache's rows come with every run). ``followup`` adds recall.py configurations "evicted-pinned" (no
recall) and "recall-pinned" (the recall's defaults); ``needle`` adds long_prompt.py's "guided-pinned" /
"guided-pinned-head" (the defaults), and the split "heldout-55-95" (the held-out split's prompts at depths 55 and 95: the same kinds, seeds and offset).
A pin is found by the fact's sentence tokens (its first and last left out: they may merge with the text
around them) in the runtime's own tokens, and is logged ("pin at POSITION: N tokens"). Give ``--out``: rows are
written in those scripts' formats.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import entrokv_edge as ek  # noqa: E402
from entrokv_edge.controller import Protect  # noqa: E402

PIN = {"llm": None, "seqs": [], "head": 0, "at": {}}


def _find(ids: np.ndarray, seq: list[int]) -> int | None:
    m = len(seq)
    if m == 0 or len(ids) < m:
        return None
    for i in np.flatnonzero(ids[: len(ids) - m + 1] == seq[0]):
        if list(ids[i: i + m]) == seq:
            return int(i)
    return None


def pinned_pages(cfg, n: int) -> list[int]:
    """The pinned facts' (and the head's) pages read so far, for n tokens read with settings ``cfg``."""
    out = set()
    llm = PIN["llm"]
    if llm is None:
        return []
    P, n_pages = cfg.page_size, cfg.n_pages(n)
    spans = [(0, min(PIN["head"], n))] if PIN["head"] else []
    ids = None
    for seq in PIN["seqs"]:
        key = (id(llm), tuple(seq))
        at = PIN["at"].get(key)
        if at is None:
            ids = np.asarray(llm.input_ids[:n]) if ids is None else ids
            at = _find(ids, seq)
            if at is None:
                continue            # not read yet
            PIN["at"][key] = at
            print(f"pin at {at}: {len(seq) + 2} tokens", flush=True)
        spans.append((max(at - 1, 0), min(at + len(seq) + 1, n)))
    for lo, hi in spans:            # each span holds at least one read token (lo < hi <= n)
        out |= {p for p in range(lo // P, (hi - 1) // P + 1) if p < n_pages}
    return sorted(out)


def pinned(policy):
    """``policy`` with the pinned pages protected as well (at the same budget)."""
    return Protect(policy, lambda n: pinned_pages(policy.config, n))


def followup(argv: list[str]) -> int:
    import recall as B
    _doc, _init = B.document, B.Chat.__init__

    def document(llm, i, length, split="tune"):
        text, facts = _doc(llm, i, length, split)
        PIN["seqs"], PIN["at"] = [B.H.text_tokens(llm, f["needle"])[1:-1] for f in facts], {}
        return text, facts

    def chat_init(self, llm):
        _init(self, llm)
        PIN["llm"] = llm        # the runtime whose chat runs now: its own tokens are searched

    B.document, B.Chat.__init__ = document, chat_init
    B.WRAP = pinned
    B.CONFIGS["evicted-pinned"], B.CONFIGS["recall-pinned"] = False, True
    return B.main(argv)


def needle(argv: list[str]) -> int:
    import long_prompt as LP
    head = False
    if "--pin" in argv:
        i = argv.index("--pin")
        if i + 1 >= len(argv) or argv[i + 1] not in ("facts", "facts+head"):
            sys.exit("--pin: facts or facts+head")
        head = argv[i + 1] == "facts+head"
        del argv[i: i + 2]
    _mp, _read = LP.magic_prompt, LP._read

    def magic_prompt(llm, length, depth, offset, seed, kind="magic", question_first=False):
        p, number = _mp(llm, length, depth, offset, seed, kind=kind, question_first=question_first)
        PIN["seqs"] = [[int(t) for t in np.asarray(p.tokens)[p.needle][1:-1]]]
        PIN["head"] = len(LP.H.chat_parts(llm, "" if question_first else p.meta["question"], system=False)[0]) \
            if head else 0
        return p, number

    def read(llm, *a, **k):
        PIN["llm"], PIN["at"] = llm, {}
        return _read(llm, *a, **k)

    LP.magic_prompt, LP._read = magic_prompt, read
    LP.WRAP = pinned
    LP.SPLITS["heldout-55-95"] = dict(LP.SPLITS["heldout"], kinds=["gate", "safe"], depths=[55, 95])
    LP.CONFIGS["guided-pinned-head" if head else "guided-pinned"] = dict()
    return LP.main(argv)


def _only_pinned(argv: list[str]) -> None:
    """The pin is on for every runtime of the process: configurations other than the pinned ones would be
    pinned too, under another name. Refuse them (the full cache's rows come with every run)."""
    if "--configs" not in argv:
        sys.exit("give --configs: only the pinned configurations (the pin holds for every runtime of the process)")
    names = []
    for a in argv[argv.index("--configs") + 1:]:
        if a.startswith("--"):
            break
        names.append(a)
    if not names or any("pinned" not in n for n in names):
        sys.exit(f"--configs {' '.join(names)}: only the pinned configurations (the pin holds for every runtime "
                 "of the process; run the others with their own script)")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("followup", "needle"):
        sys.exit(__doc__)
    _only_pinned(sys.argv[2:])
    sys.exit(followup(sys.argv[2:]) if sys.argv[1] == "followup" else needle(sys.argv[2:]))
