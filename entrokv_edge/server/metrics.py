"""The server's counters, and ``GET /metrics`` in Prometheus' text format (what llama-server exposes, and
what a supervisor or a dashboard polls)."""
from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    """Counters of one server process (thread-safe: the routes run the model in worker threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()          # (route, status) -> requests answered
        self.prompt_tokens = 0                      # tokens the model evaluated for requests (their prompts)
        self.generated_tokens = 0                   # tokens generated for requests
        self.cancelled = 0                          # generations stopped because their client went away
        self.refused_busy = 0                       # requests refused with 503 (the queue was full)

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def answered(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[route, int(status)] += 1

    def render(self, ready: bool, queue: dict, llm=None, conversations: dict | None = None) -> str:
        """The Prometheus text: requests, tokens, cancellations, the queue; once the model is loaded, its
        KV figures (bytes held vs a full cache, evictions, the recall store) and the conversation cache's."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
            out.append(f"# HELP entrokv_{name} {help_}")
            out.append(f"# TYPE entrokv_{name} {kind}")
            for labels, v in samples:
                lab = ",".join(f'{k}="{val}"' for k, val in labels.items())
                out.append(f"entrokv_{name}{{{lab}}} {v}" if lab else f"entrokv_{name} {v}")

        with self._lock:
            reqs = sorted(self.requests.items())
            metric("ready", "gauge", "1 once the model is loaded, 0 while it loads.", [({}, int(ready))])
            metric("requests_total", "counter", "Requests answered, by route and HTTP status.",
                   [({"route": r, "status": s}, n) for (r, s), n in reqs] or [({"route": "", "status": "200"}, 0)])
            metric("prompt_tokens_total", "counter", "Tokens evaluated for requests.", [({}, self.prompt_tokens)])
            metric("generated_tokens_total", "counter", "Tokens generated for requests.", [({}, self.generated_tokens)])
            metric("cancelled_total", "counter", "Generations stopped because their client disconnected.",
                   [({}, self.cancelled)])
            metric("refused_busy_total", "counter", "Requests refused with 503: the queue was full.",
                   [({}, self.refused_busy)])
        metric("queue_depth", "gauge", "Generating requests in the server (one generates, the others wait).",
               [({}, queue.get("active", 0))])
        metric("queue_limit", "gauge", "Requests the server admits at once.", [({}, queue.get("limit", 0))])
        if llm is not None:
            rep = llm.kv_report()
            rc = rep["recall"]
            metric("kv_bytes_held", "gauge", "KV bytes the cache holds now.", [({}, rep["kv_bytes_kept"])])
            metric("kv_bytes_full", "gauge", "KV bytes a full cache would hold for the current conversation.",
                   [({}, rep["kv_bytes_full"])])
            metric("kv_bytes_allocated", "gauge", "KV bytes allocated for the cache.", [({}, rep["kv_bytes_allocated"])])
            metric("logical_tokens", "gauge", "Tokens of the current conversation.", [({}, rep["logical_tokens"])])
            metric("kept_tokens", "gauge", "Tokens the cache holds.", [({}, rep["kept_tokens"])])
            metric("evictions_total", "counter", "Evictions since the server started.", [({}, rep["evictions"])])
            metric("store_bytes", "gauge", "Bytes of evicted tokens kept outside the cache (recall store), by place.",
                   [({"where": "memory"}, rc.get("store_bytes_in_memory", 0) + rc.get("digest_bytes", 0)),
                    ({"where": "file"}, rc.get("store_bytes", 0) - rc.get("store_bytes_in_memory", 0))])
        if conversations is not None:
            metric("conversations", "gauge", "Saved conversation states.", [({}, conversations["conversations"])])
            metric("conversation_bytes", "gauge", "Bytes of saved conversation states.", [({}, conversations["bytes"])])
            metric("conversation_hits_total", "counter", "Requests that went on from a saved conversation state.",
                   [({}, conversations.get("hits", 0))])
            metric("conversation_evictions_total", "counter", "Saved conversation states dropped at the caps.",
                   [({}, conversations.get("evicted", 0))])
        return "\n".join(out) + "\n"
