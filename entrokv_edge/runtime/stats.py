"""What a runtime has done: one small object of counters, reported by ``kv_report()``."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RuntimeStats:
    """Counters since the instance was made (``reset`` does not clear them).

    evaluated   tokens given to eval (the drafts not counted)
    evictions   evictions, and ``eviction_s`` their wall time (selection, compaction, the lookahead draft)
    guided      evictions between pieces of a prompt that its guide steered, ``guide_s`` the guide's time
    drafted     tokens drafted to score evictions (lookahead's, the guide's), then removed
    reselected  set-aside tokens a reselect brought back (all (layer, KV group) buffers together)
    recalls     recalls (at turns and while decoding), ``recall_s`` their wall time (reading, scoring, swapping,
                the turn's draft and requery), ``recalled`` the tokens they brought back (all buffers),
                ``recall_drafted`` the tokens drafted at turns to drive a recall, ``recalls_on_decode`` the
                decoding recalls that used the decode's own attention
    """

    evaluated: int = 0
    evictions: int = 0
    eviction_s: float = 0.0
    guided: int = 0
    guide_s: float = 0.0
    drafted: int = 0
    reselected: int = 0
    recalls: int = 0
    recall_s: float = 0.0
    recalled: int = 0
    recall_drafted: int = 0
    recalls_on_decode: int = 0

    def as_dict(self) -> dict:
        return asdict(self)
