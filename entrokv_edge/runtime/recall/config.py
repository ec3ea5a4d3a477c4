"""The recall's settings: ``recall=True``, a dict of them, or a RecallConfig."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


TURNS = ("recall", "reselect")


@dataclass(frozen=True)
class RecallConfig:
    """``every``: decoded tokens between two recalls; ``pages``: pages read and offered per
    (layer, KV group) at each of them; ``turn_pages``: the same at a new turn; ``page_size``: true
    positions per page of the store (its own, rounded up to whole eviction pages); ``directory``:
    keep the store's rows in a file there (without a name, gone with the store) instead of host
    memory; ``turn``: what a new turn does, "recall" (its queries rank the stored pages by their digests and
    swap the best in, then ``turn_requery`` and ``turn_draft``) or "reselect" (its last token is taken out, an
    eviction chooses among the cache and the whole store by the turn's queries, and the last token is evaluated
    again; with ``turn_draft`` the answer's first tokens drafted first join its queries); ``decode``: recalls
    while decoding (every ``every`` tokens); ``first_turn``: the first prompt's own queries recall too, after
    its own eviction (off: a single prompt is answered as without recall); ``store_mib``: the most the store's
    rows may take (MiB, in memory or in its file); at the cap, what later evictions drop is dropped for good (``kv_report()["recall"]
    ["dropped_tokens_per_group"]`` counts it), None: no cap. Defaults: docs/research.md,
    "The recall tier"."""

    every: int = 4
    pages: int = 8
    page_size: int = 16
    directory: str | None = None
    turn_pages: int = 128
    turn_draft: int = 16                  # answer tokens drafted at a turn to drive a second recall (0: none)
    hold_draft: bool = True               # decoding recalls also see the turn's draft queries not yet decoded
    turn_requery: bool = True             # the turn's window evaluated again after its recall, driving a second one
    turn: str = "recall"                  # what a new turn does: "recall" or "reselect"
    decode: bool = True                   # recalls while decoding
    store_mib: float | None = 1024.0      # the store's rows at most (MiB); evictions beyond it are final. None: no cap
    first_turn: bool = True               # the first prompt's queries recall after its own eviction

    def __post_init__(self):
        if self.directory is not None:
            d = os.fspath(self.directory)
            if not os.path.isdir(d) or not os.access(d, os.W_OK):
                raise ValueError(f"recall directory {d!r} is not a writable directory")
            object.__setattr__(self, "directory", d)
        for name, lo, hi in (("every", 1, 4096), ("pages", 1, 4096), ("page_size", 1, 4096),
                             ("turn_pages", 1, 4096), ("turn_draft", 0, 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"recall {name} must be an integer in {lo}..{hi}, got {v!r}")
        if self.turn not in TURNS:
            raise ValueError(f"recall turn must be one of {', '.join(TURNS)}, got {self.turn!r}")
        if self.store_mib is not None and (isinstance(self.store_mib, bool) or not isinstance(self.store_mib, (int, float))
                                           or not 0 < self.store_mib < 1 << 30):
            raise ValueError(f"recall store_mib must be a number of MiB > 0 or None, got {self.store_mib!r}")
        for name in ("hold_draft", "turn_requery", "decode", "first_turn"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"recall {name} must be True or False, got {getattr(self, name)!r}")


# recall="turns": later turns of a chat bring back what their questions need (docs/research.md, "Later turns"); a
# single prompt is answered as without recall (no recall after the first prompt's own eviction, none while
# decoding); the store's rows in a temporary file, not in memory
LATER_TURNS = dict(turn_requery=False, turn_draft=0, decode=False, first_turn=False)


def turns_recall() -> RecallConfig:
    """``recall="turns"``: LATER_TURNS, its store in the temporary directory (in memory where none is writable)."""
    d = tempfile.gettempdir()
    return RecallConfig(**LATER_TURNS, directory=d if os.path.isdir(d) and os.access(d, os.W_OK) else None)


def recall_config(value) -> RecallConfig | None:
    """The ``recall`` option: None / False (off, the default), "turns" (``turns_recall()``: later turns only),
    True or "full" (the full tier: RecallConfig's own defaults, the store in memory), a dict of RecallConfig's
    fields, or a RecallConfig."""
    if value is None or value is False:
        return None
    if value == "turns":
        return turns_recall()
    if value is True or value == "full":
        return RecallConfig()
    if isinstance(value, RecallConfig):
        return value
    if isinstance(value, dict):
        return RecallConfig(**value)
    raise TypeError(f"recall must be False, \"turns\", True / \"full\", a dict or a RecallConfig, got {value!r}")
