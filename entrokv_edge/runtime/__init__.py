"""The runtime: EntroKVLlama (a llama_cpp.Llama with Page-EntroKV eviction) and the rooms it works in:
reading.py (a prompt in pieces, the guide), eviction.py (the eviction step, EvictionController), drafts.py
(every draft), store.py (evicted tokens kept outside the cache), recall/ (the recall tier), reselect.py,
state.py and session.py (saved states and session files), stats.py (counters), rpc.py (llama.cpp's RPC)."""
from .eviction import EvictionController, EvictionResult, PageEntroKV
from .llama import EntroKVLlama
from .recall import RecallConfig
from .session import EntroKVState, SessionError
from .stats import RuntimeStats

__all__ = ["EntroKVLlama", "EntroKVState", "EvictionController", "EvictionResult", "PageEntroKV", "RecallConfig",
           "RuntimeStats", "SessionError"]
