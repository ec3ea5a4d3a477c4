"""The runtime: EntroKVLlama (a llama_cpp.Llama with Page-EntroKV eviction), its saved states
and session files."""
from .llama import EntroKVLlama
from .session import EntroKVState, SessionError

__all__ = ["EntroKVLlama", "EntroKVState", "SessionError"]
