"""The runtime: EntroKVLlama (a llama_cpp.Llama with Page-EntroKV eviction) and the CLI."""
from .llama import EntroKVLlama

__all__ = ["EntroKVLlama"]
