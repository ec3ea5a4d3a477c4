"""Named callbacks on what a runtime does, for logs, tests and oracles that watch it without patching it.

    stop = llm.events.listen("evicted", lambda rt, controller, result: print(result.metrics["kept_tokens"]))
    ...
    stop()                  # no longer called

Every callback gets keyword arguments; what each event passes is in ``EVENTS``. A callback's exception
propagates to the call that emitted it (the runtime's own error handling then applies, as for any error).
"""
from __future__ import annotations

from typing import Callable

EVENTS = {
    "eval": "rt, tokens: a call of eval (a prompt, a turn or a decoded token), before anything is evaluated",
    "evicting": "rt, controller, scores, aside: an eviction about to run (its controller, window scores, the store "
                "a reselect may choose from or None)",
    "compacting": "rt, true_pos, cells: right before the compaction (the slots' true positions, None when cells "
                  "are positions; the cells [n_slots, K] each keeps)",
    "evicted": "rt, controller, result: an eviction done (its EvictionResult)",
    "drafted": "rt, kind, k, room, drafted: a draft to score an eviction (kind 'lookahead' or 'guide': the tokens "
               "asked for, the cells free for it, the tokens drafted)",
    "recalling": "queries, qpos, n_pages, att: a recall about to run (its queries [L, I, H, d] at true positions "
                 "qpos [I], the pages offered per buffer, the decode's attention of its first queries or None)",
    "recall_inputs": "slots, att, lse, scale: a recall's attention for a run of slots, as its plan receives it",
}


class Events:
    """Callbacks by event name (``EVENTS``)."""

    def __init__(self):
        self._fns: dict[str, list[Callable]] = {}

    def listen(self, name: str, fn: Callable) -> Callable[[], None]:
        """Call ``fn(**payload)`` on every ``name`` event from now on; returns what stops it."""
        if name not in EVENTS:
            raise ValueError(f"unknown event {name!r}; events: {', '.join(EVENTS)}")
        self._fns.setdefault(name, []).append(fn)

        def stop() -> None:
            fns = self._fns.get(name, [])
            if fn in fns:
                fns.remove(fn)
        return stop

    def wants(self, name: str) -> bool:
        return bool(self._fns.get(name))

    def emit(self, name: str, **payload) -> None:
        for fn in list(self._fns.get(name, ())):
            fn(**payload)
