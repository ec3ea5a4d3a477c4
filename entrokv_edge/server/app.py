"""The server's app: llama-cpp-python's own FastAPI app serving one EntroKVLlama, with a cache of
conversations' compressed states and the KV figures in every answer.

What this relies on in llama-cpp-python 0.3.36 (pinned; tests/test_server.py fails if it moves):

- ``llama_cpp.server.app.create_app`` always builds a plain ``LlamaProxy`` that loads
  ``llama_cpp.Llama`` from model settings (no class hook). We give it the model vocabulary only
  (cheap), then replace the module global ``_llama_proxy``, the one object ``get_llama_proxy``
  hands every route under its locks, with ``_OneModel`` serving our instance.
- The streaming routes call the unbound ``Llama.create_chat_completion`` / ``Llama.__call__``;
  those reach the instance through ``self.chat_handler`` and ``self.create_completion``, which we
  wrap on the served instance (``_install``) to report the KV figures.
- The non-streaming routes validate answers against TypedDict response models that drop unknown
  fields, and their error handler answers an invalid request body with a 500 and a traceback:
  ``Door`` (door.py), the outermost ASGI app, checks bodies first and puts the report back.
"""
from __future__ import annotations

import re
import time
from typing import Callable

from .._loader import ensure_llama_cpp
from .defaults import DEFAULT_CONVERSATIONS, DEFAULT_CONVERSATIONS_MIB
from .door import ADMITTED, GONE, REPORT, Door

llama_cpp = ensure_llama_cpp()
from llama_cpp import llama_chat_format  # noqa: E402  (after the patched library is bound)
from fastapi import Depends  # noqa: E402  (the [server] extra: its absence is reported by the command)
from llama_cpp.llama_cache import LlamaRAMCache  # noqa: E402
from llama_cpp.server import app as lcs  # noqa: E402
from llama_cpp.server.settings import ModelSettings, ServerSettings  # noqa: E402
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest  # noqa: E402

REPORT_FIELDS = ("logical_tokens", "kept_tokens", "kv_cells", "kv_bytes_full", "kv_bytes_kept", "evictions")


class ConversationCache(LlamaRAMCache):
    """Saved states (EntroKVState: llama.cpp's state of the compressed cache, the true positions,
    the last logits, the window scores) of recent conversations, keyed by their tokens.

    llama-cpp-python's completion path uses it as any ``BaseLlamaCache``: before a request it loads
    the state with the longest common prefix, if that is longer than what the context holds;
    after it, it stores ``save_state()`` under prompt + completion. A new turn's key extends its
    conversation's previous key, so that state is dropped: one state per conversation. The least
    recently used go first beyond ``max_states`` states or ``capacity_bytes`` (a state larger than
    that is not kept). Touched only under the model's lock. (No ``__len__``: llama-cpp-python tests
    ``if self.cache``, and an empty cache must still be used.)
    """

    def __init__(self, max_states: int, capacity_bytes: int, llm=None):
        super().__init__(capacity_bytes)
        self.max_states, self.llm = max_states, llm
        self.hits = self.evicted = 0

    @property
    def cache_size(self) -> int:
        return sum(s.nbytes for s in self.cache_state.values())

    def __getitem__(self, key):
        state = super().__getitem__(key)
        if self.llm is not None:        # a hit: the state goes on further than what the context holds (it is loaded)
            key = list(key)
            held = self.llm.input_ids[: self.llm.n_tokens].tolist()
            if llama_cpp.Llama.longest_token_prefix(state.input_ids.tolist(), key) > \
                    llama_cpp.Llama.longest_token_prefix(held, key):
                self.hits += 1
        return state

    def __setitem__(self, key, value) -> None:
        gone = GONE.get()
        if gone is not None and gone.is_set():      # a generation its client left: not kept, half an answer
            return
        key = tuple(key)
        for k in [k for k in self.cache_state if key[: len(k)] == k]:   # its conversation's earlier turns
            del self.cache_state[k]
        self.cache_state[key] = value
        while self.cache_state and (len(self.cache_state) > self.max_states or self.cache_size > self.capacity_bytes):
            self.cache_state.popitem(last=False)
            self.evicted += 1

    def stats(self) -> dict:
        return {"conversations": len(self.cache_state), "bytes": self.cache_size,
                "max_conversations": self.max_states, "max_bytes": self.capacity_bytes, "hits": self.hits,
                "evicted": self.evicted}


# --- the served instance: KV figures per answer ------------------------------------------------

def _report(llm, evaluated_before: int, t_start: float | None = None, t_first: float | None = None) -> dict:
    """The KV figures of an answer, and its times: ``queued_s`` (admitted to the model taken), ``first_token_s``
    (the model taken to the first token streamed; None for an answer sent whole), ``seconds`` (the model taken
    to the answer's end)."""
    rep = llm.kv_report()
    rc = rep["recall"]
    now, admitted = time.perf_counter(), ADMITTED.get()
    times = {"queued_s": None if admitted is None or t_start is None else t_start - admitted,
             "first_token_s": None if t_first is None or t_start is None else t_first - t_start,
             "seconds": None if t_start is None else now - t_start}
    return {**{k: rep[k] for k in REPORT_FIELDS}, **times, "evaluated_tokens": llm.stats.evaluated - evaluated_before,
            "store_bytes": rc.get("store_bytes", 0) + rc.get("digest_bytes", 0),
            "store_bytes_in_memory": rc.get("store_bytes_in_memory", 0) + rc.get("digest_bytes", 0)}


def _gone_criterion():
    """A stopping criterion (llama-cpp-python's: called with the ids and logits after each token) true once the
    request's client has disconnected (GONE, set by the door), or None outside a served request."""
    gone = GONE.get()
    return None if gone is None else (lambda ids, logits: gone.is_set())


def _reword(message: str, llm) -> str:
    """llama-cpp-python words a too-long prompt with llama_n_ctx (our physical cache); the limit
    is the logical context. (Its server maps this message to a 400 context_length_exceeded.)"""
    return re.sub(r"exceed context window of \d+", f"exceed context window of {llm._n_ctx}", message)


def _reporting(call, llm, streams: dict, metrics=None):
    """``call`` (create_completion or a chat handler) whose answer carries the KV figures: a
    stream on its final chunk (the one with a finish_reason), a single answer through REPORT. With ``metrics``
    (create_completion's wrapper): the generation stops once its client is gone, and its tokens are counted."""
    def wrapped(*args, **kwargs):
        _end_abandoned(streams)
        start, t_start = llm.stats.evaluated, time.perf_counter()
        if metrics is not None:
            stop = _gone_criterion()
            if stop is not None:
                kwargs["stopping_criteria"] = llama_cpp.StoppingCriteriaList(
                    [*(kwargs.get("stopping_criteria") or []), stop])
        try:
            out = call(*args, **kwargs)
        except ValueError as e:
            e.args = (_reword(str(e), llm),)
            raise
        if isinstance(out, dict):
            holder = REPORT.get()
            if holder is not None:
                holder["entrokv"] = _report(llm, start, t_start)
            if metrics is not None:
                n = (out.get("usage") or {}).get("completion_tokens", 0)
                metrics.add(generated_tokens=n, prompt_tokens=max(llm.stats.evaluated - start - n, 0))
            return out
        streams["last"] = _stream(out, llm, start, metrics, t_start)
        return streams["last"]
    return wrapped


def _end_abandoned(streams: dict) -> None:
    """End the last stream if its client went away: llama-cpp-python then stops iterating it and
    releases the model's lock, but the generator stays suspended inside EntroKVLlama.generate,
    which refuses a second generation until it is closed. Called under the model's lock; waits
    for a step still running in the abandoned request's worker thread."""
    gen = streams.get("last")
    while gen is not None and gen.gi_running:
        time.sleep(0.005)
    if gen is not None:
        gen.close()


def _stream(chunks, llm, start: int, metrics=None, t_start: float | None = None):
    n, t_first = 0, None
    try:
        for chunk in chunks:
            if any(c.get("finish_reason") for c in chunk.get("choices", ())):
                chunk["entrokv"] = _report(llm, start, t_start, t_first)
            elif chunk.get("choices"):
                n += 1
                t_first = t_first or time.perf_counter()
            yield chunk
    except ValueError as e:
        e.args = (_reword(str(e), llm),)
        raise
    finally:
        chunks.close()
        if metrics is not None:
            metrics.add(generated_tokens=n, prompt_tokens=max(llm.stats.evaluated - start - n, 0))


def _install(llm, metrics=None) -> Callable[[], None]:
    """Wrap the served instance's chat handler and create_completion (see the module docstring);
    returns what ends a stream left unfinished (before the model is closed)."""
    handler = (llm.chat_handler or llm._chat_handlers.get(llm.chat_format)     # as Llama.create_chat_completion
               or llama_chat_format.get_chat_completion_handler(llm.chat_format))
    streams: dict = {}
    llm.chat_handler = _reporting(handler, llm, streams)
    llm.create_completion = _reporting(llm.create_completion, llm, streams, metrics)
    return lambda: _end_abandoned(streams)


class _OneModel:
    """What llama-cpp-python's routes use of their LlamaProxy: called with a request's model name,
    it returns the model (ours, whatever the name); iterated, the names /v1/models lists."""

    def __init__(self, llm, alias: str):
        self.llm, self.alias = llm, alias

    def __call__(self, model: str | None = None):
        return self.llm

    def __iter__(self):
        yield self.alias


# --- the app and the command -------------------------------------------------------------------

ROUTES = {"/v1/chat/completions": CreateChatCompletionRequest, "/v1/completions": CreateCompletionRequest}


def build_app(llm, alias: str, door: Door, conversations: int = DEFAULT_CONVERSATIONS,
              conversations_mib: float = DEFAULT_CONVERSATIONS_MIB):
    """llama-cpp-python's FastAPI app serving ``llm`` (an EntroKVLlama) as model ``alias`` behind ``door``
    (door.py: keys, health, metrics, admission, checks), with a ConversationCache of ``conversations``
    states / ``conversations_mib`` MiB and ``GET /entrokv/stats``; the door serves it from then on. One per
    process: llama-cpp-python's server keeps its model in a module global."""
    if not hasattr(lcs, "_llama_proxy"):
        raise RuntimeError("this llama-cpp-python's server has no _llama_proxy to serve our model through "
                           f"(built for 0.3.36, found {llama_cpp.__version__})")
    # interrupt_requests off: a waiting request must not cut the running stream short;
    # api_key given: pydantic-settings would otherwise read it from the environment
    app = lcs.create_app(server_settings=ServerSettings(interrupt_requests=False, api_key=None),
                         model_settings=[ModelSettings(model=str(llm.model_path), model_alias=alias,
                                                       vocab_only=True, verbose=False)])
    lcs._llama_proxy.free()
    lcs._llama_proxy = _OneModel(llm, alias)
    cache = ConversationCache(conversations, int(conversations_mib * (1 << 20)), llm)
    llm.set_cache(cache)
    app.state.end_streams = _install(llm, door.metrics)
    counters = door.counters

    @app.get("/entrokv/stats", tags=["EntroKV"])
    def stats(proxy=Depends(lcs.get_llama_proxy)) -> dict:
        """The saved conversations, the current context's KV figures, the requests in the server."""
        rep = {k: v for k, v in proxy().kv_report().items() if k != "layers"}
        return {"model": alias, "conversations": proxy().cache.stats(), "kv": rep, "requests": dict(counters)}
    door.ready(app, llm, cache)
    return app
