"""The Python controller: settings, head weights, pages, policies and metrics (numpy)."""
from .config import METHOD_POLICIES, POLICIES, EvictionConfig
from .controller import EvictionResult, PageEntroKV
from .policies import Selection, select

__all__ = ["METHOD_POLICIES", "POLICIES", "EvictionConfig", "EvictionResult", "PageEntroKV", "Selection", "select"]
