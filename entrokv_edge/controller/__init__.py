"""The Python controller: settings, head weights, pages, policies and metrics (numpy)."""
from .config import METHOD_POLICIES, POLICIES, EvictionConfig
from .controller import EvictionController, EvictionResult, PageEntroKV
from .policies import Selection, select

__all__ = ["METHOD_POLICIES", "POLICIES", "EvictionConfig", "EvictionController", "EvictionResult", "PageEntroKV", "Selection", "select"]
