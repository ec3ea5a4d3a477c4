"""The recall tier (``recall=True``): evicted tokens kept in the store (runtime/store.py) and brought back
when the queries being answered want them. config.py: its settings; tier.py: the recall's state and
decisions; swap.py: one recall's attention, plan and row moves; turns.py: how the runtime drives it at a
new turn and while decoding."""
from .config import RecallConfig, recall_config
from .tier import Recall

__all__ = ["Recall", "RecallConfig", "recall_config"]
