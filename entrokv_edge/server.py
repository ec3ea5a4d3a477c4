"""``entrokv-edge serve``: an OpenAI-compatible HTTP server (``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``, streaming or not) on one EntroKVLlama, through
llama-cpp-python's own server stack (its ``[server]`` extra; ours: ``pip install -e ".[server]"``).
Conversations longer than the cache work as they do in Python; the compressed states of recent
conversations are kept, so a returning conversation goes on without re-reading its history; every
answer carries an ``entrokv`` field with its KV figures. See docs/server.md.

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
  ``_Door``, an ASGI middleware in front, checks bodies first and puts the report back.
"""
from __future__ import annotations

import contextvars
import json
import re
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from ._loader import ensure_llama_cpp

llama_cpp = ensure_llama_cpp()
from llama_cpp.llama_cache import LlamaRAMCache  # noqa: E402  (after the patched library is bound)

DEFAULT_PORT = 8000
DEFAULT_CONVERSATIONS = 8
DEFAULT_CONVERSATIONS_MIB = 1024
DEFAULT_QUEUE = 8
REPORT_FIELDS = ("logical_tokens", "kept_tokens", "kv_cells", "kv_bytes_full", "kv_bytes_kept", "evictions")
INSTALL_HINT = 'pip install -e ".[server]" (from a clone) or pip install "entrokv-edge[server]"'

# the report of the request being served, for _Door to put into a non-streaming answer; a
# ContextVar because the route runs the model in a worker thread, which gets a copy of the context
_REPORT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("entrokv_report", default=None)


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

    def __init__(self, max_states: int, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self.max_states = max_states

    @property
    def cache_size(self) -> int:
        return sum(s.nbytes for s in self.cache_state.values())

    def __setitem__(self, key, value) -> None:
        key = tuple(key)
        for k in [k for k in self.cache_state if key[: len(k)] == k]:   # its conversation's earlier turns
            del self.cache_state[k]
        self.cache_state[key] = value
        while self.cache_state and (len(self.cache_state) > self.max_states or self.cache_size > self.capacity_bytes):
            self.cache_state.popitem(last=False)

    def stats(self) -> dict:
        return {"conversations": len(self.cache_state), "bytes": self.cache_size,
                "max_conversations": self.max_states, "max_bytes": self.capacity_bytes}


# --- the served instance: KV figures per answer ------------------------------------------------

def _report(llm, evaluated_before: int) -> dict:
    rep = llm.kv_report()
    return {**{k: rep[k] for k in REPORT_FIELDS}, "evaluated_tokens": llm.n_evaluated - evaluated_before}


def _reword(message: str, llm) -> str:
    """llama-cpp-python words a too-long prompt with llama_n_ctx (our physical cache); the limit
    is the logical context. (Its server maps this message to a 400 context_length_exceeded.)"""
    return re.sub(r"exceed context window of \d+", f"exceed context window of {llm._n_ctx}", message)


def _reporting(call, llm, streams: dict):
    """``call`` (create_completion or a chat handler) whose answer carries the KV figures: a
    stream on its final chunk (the one with a finish_reason), a single answer through _REPORT."""
    def wrapped(*args, **kwargs):
        _end_abandoned(streams)
        start = llm.n_evaluated
        try:
            out = call(*args, **kwargs)
        except ValueError as e:
            e.args = (_reword(str(e), llm),)
            raise
        if isinstance(out, dict):
            holder = _REPORT.get()
            if holder is not None:
                holder["entrokv"] = _report(llm, start)
            return out
        streams["last"] = _stream(out, llm, start)
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


def _stream(chunks, llm, start: int):
    try:
        for chunk in chunks:
            if any(c.get("finish_reason") for c in chunk.get("choices", ())):
                chunk["entrokv"] = _report(llm, start)
            yield chunk
    except ValueError as e:
        e.args = (_reword(str(e), llm),)
        raise
    finally:
        chunks.close()


def _install(llm) -> Callable[[], None]:
    """Wrap the served instance's chat handler and create_completion (see the module docstring);
    returns what ends a stream left unfinished (before the model is closed)."""
    from llama_cpp import llama_chat_format
    handler = (llm.chat_handler or llm._chat_handlers.get(llm.chat_format)     # as Llama.create_chat_completion
               or llama_chat_format.get_chat_completion_handler(llm.chat_format))
    streams: dict = {}
    llm.chat_handler = _reporting(handler, llm, streams)
    llm.create_completion = _reporting(llm.create_completion, llm, streams)
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


# --- the door: admission, request checks, the report in single answers --------------------------

def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> tuple[int, dict]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _send_json(send, status: int, body: dict) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})


def _check(body: bytes, model) -> tuple[int, dict] | None:
    """What is wrong with a request body, as (status, OpenAI-style error), or None."""
    from pydantic import ValidationError
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        return _error(422, f"{where}: {err['msg']}", where)
    if getattr(req, "messages", None) == []:        # llama-cpp-python's request model defaults it to []
        return _error(422, "messages: at least one message is required", "messages")
    if (req.logprobs is not None and req.logprobs is not False) or getattr(req, "top_logprobs", None):
        return _error(400, "logprobs are not available: the cache holds fewer tokens than the conversation, "
                           "so there are no per-token logits to report", "logprobs")
    return None


class _Door:
    """Pure ASGI middleware in front of llama-cpp-python's app, on the two generating routes.

    Admission: at most ``limit`` requests at a time (one generating, the rest waiting for
    llama-cpp-python's model lock); one more gets a 503 with an OpenAI-style error, so a burst
    cannot pile up connections and memory. Checks: a body llama-cpp-python's own request models
    refuse gets a 422 (its route handler would answer 500 with a traceback), logprobs a 400.
    Report: the ``entrokv`` field the response model dropped goes back into a JSON answer.
    """

    def __init__(self, app, routes: dict, counters: dict):
        self.app, self.routes, self.counters = app, routes, counters

    async def __call__(self, scope, receive, send):
        model = self.routes.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if model is None:
            return await self.app(scope, receive, send)
        c = self.counters
        if c["active"] >= c["limit"]:
            c["refused"] += 1
            return await _send_json(send, *_error(503, f"busy: {c['limit']} requests are in the server already "
                                                       "(one generates, the others wait); retry later", code="busy"))
        c["active"] += 1
        try:
            body, more = b"", True
            while more:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body, more = body + msg.get("body", b""), msg.get("more_body", False)
            refusal = _check(body, model)
            if refusal is not None:
                return await _send_json(send, *refusal)
            replay = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive_again():
                return replay.pop() if replay else await receive()
            reply = _Reply(send)
            token = _REPORT.set(reply.report)
            try:
                await self.app(scope, receive_again, reply.send)
            except Exception as e:      # an answer must end cleanly, never as a cut connection
                await reply.fail(e)
            else:
                await reply.close()
            finally:
                _REPORT.reset(token)
        finally:
            c["active"] -= 1


class _Reply:
    """The answer to one admitted request, on its way out: a successful JSON answer gets
    ``report["entrokv"]`` (an event stream's final chunk carries it already); an error raised
    inside the app becomes a 500 JSON error if nothing was sent yet, else (a stream, whose status
    went out with its first byte) an OpenAI error event, on which the openai client raises APIError."""

    def __init__(self, send):
        self._send, self.report = send, {}
        self.started = self.finished = self.streaming = False
        self._held, self._parts, self._end = None, [], None

    async def send(self, msg):
        if msg["type"] == "http.response.start":
            self.started = True
            ctype = dict(msg.get("headers", [])).get(b"content-type", b"")
            self.streaming = ctype.startswith(b"text/event-stream")
            if msg["status"] == 200 and ctype.startswith(b"application/json"):
                self._held = msg
                return
        elif msg["type"] == "http.response.body":
            self.finished = not msg.get("more_body", False)
            if self.streaming and self.finished:      # held until the app returns: an error may follow
                self._end = msg
                return
            if self._held is not None:
                self._parts.append(msg.get("body", b""))
                if self.finished:
                    data = json.loads(b"".join(self._parts))
                    data.update(self.report)
                    raw = json.dumps(data).encode()
                    headers = [(k, v) for k, v in self._held["headers"] if k != b"content-length"]
                    await self._send({**self._held, "headers": headers + [(b"content-length", str(len(raw)).encode())]})
                    await self._send({"type": "http.response.body", "body": raw})
                return
        await self._send(msg)

    async def close(self) -> None:
        if self._end is not None:
            await self._send(self._end)

    async def fail(self, e: Exception) -> None:
        while len(getattr(e, "exceptions", ())) == 1:       # anyio task groups wrap what they raise
            e = e.exceptions[0]
        if isinstance(e, ValueError):
            print(f"entrokv-edge serve: request refused: {e}", file=sys.stderr)
        else:
            traceback.print_exception(e, file=sys.stderr)
        code = "context_length_exceeded" if "exceed context window" in str(e) else None
        status, body = _error(400 if isinstance(e, ValueError) else 500, str(e), code=code)
        if not self.started:
            return await _send_json(self._send, status, body)
        if self.streaming:
            event = b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
            await self._send({"type": "http.response.body", "body": event, "more_body": False})


# --- the app and the command -------------------------------------------------------------------

def build_app(llm, alias: str, conversations: int = DEFAULT_CONVERSATIONS,
              conversations_mib: float = DEFAULT_CONVERSATIONS_MIB, queue: int = DEFAULT_QUEUE):
    """llama-cpp-python's FastAPI app serving ``llm`` (an EntroKVLlama) as model ``alias``, with a
    ConversationCache of ``conversations`` states / ``conversations_mib`` MiB, at most ``queue``
    requests waiting while one generates, and ``GET /entrokv/stats``. One per process: llama-cpp-python's
    server keeps its model in a module global."""
    from fastapi import Depends
    from llama_cpp.server import app as lcs
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
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
    llm.set_cache(ConversationCache(conversations, int(conversations_mib * (1 << 20))))
    app.state.end_streams = _install(llm)
    counters = {"limit": queue + 1, "active": 0, "refused": 0}
    app.add_middleware(_Door, routes={"/v1/chat/completions": CreateChatCompletionRequest,
                                      "/v1/completions": CreateCompletionRequest}, counters=counters)

    @app.get("/entrokv/stats", tags=["EntroKV"])
    def stats(proxy=Depends(lcs.get_llama_proxy)) -> dict:
        """The saved conversations, the current context's KV figures, the requests in the server."""
        rep = {k: v for k, v in proxy().kv_report().items() if k != "layers"}
        return {"model": alias, "conversations": proxy().cache.stats(), "kv": rep, "requests": dict(counters)}
    return app


def add_parser(sub, common) -> None:
    """The ``serve`` subcommand; ``common`` holds the model and eviction flags ``run`` has."""
    from .cli import _at_least, _finite
    p = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback; no authentication)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0: a free one")
    p.add_argument("--conversations", type=_at_least(0), default=DEFAULT_CONVERSATIONS,
                   help=f"saved conversation states kept (default {DEFAULT_CONVERSATIONS}; 0: none)")
    p.add_argument("--conversations-mib", type=_finite, default=DEFAULT_CONVERSATIONS_MIB,
                   help=f"memory for saved conversation states, MiB (default {DEFAULT_CONVERSATIONS_MIB})")
    p.add_argument("--queue", type=_at_least(0), default=DEFAULT_QUEUE,
                   help=f"requests that may wait while one generates; more get 503 (default {DEFAULT_QUEUE})")


def _listen(host: str, port: int) -> socket.socket:
    from .cli import CLIError
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def main(args) -> int:
    """Serve until SIGINT or SIGTERM (then exit status 0)."""
    from .cli import CLIError, _load
    try:
        import uvicorn
        import llama_cpp.server.app  # noqa: F401
    except ImportError as e:
        raise CLIError(f"serve needs the server extra ({e.name or e} is missing): {INSTALL_HINT}")
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if min(args.conversations, args.conversations_mib, args.queue) < 0:
        raise CLIError("--conversations, --conversations-mib and --queue must be >= 0")
    sock = _listen(args.host, args.port)          # before the model loads: a busy port fails at once
    llm = app = None
    try:
        llm = _load(args, None)
        if isinstance(llm.config.budget, int) and llm.config.budget > llm.kv_cells - llm.reserve:
            raise CLIError(f"budget of {llm.config.budget} tokens is above what a {llm.kv_cells}-cell cache can keep "
                           f"({llm.kv_cells - llm.reserve}, leaving room for new tokens); lower --budget or raise --kv-cells")
        alias = Path(args.model).name.removesuffix(".gguf")
        app = build_app(llm, alias, args.conversations, args.conversations_mib, args.queue)
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"entrokv-edge serve: {alias} on http://{host}:{port}/v1 ({llm.kv_cells} KV cells, "
              f"up to {args.conversations} saved conversations in {args.conversations_mib:g} MiB)",
              file=sys.stderr, flush=True)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again with the
        # handlers it found: ours let main return 0 (Python's would exit 130 or die by SIGTERM)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
        config = uvicorn.Config(app, log_level="info" if args.verbose else "warning", access_log=args.verbose,
                                timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        if app is not None:
            app.state.end_streams()      # a stream cut by the shutdown may still be in a worker thread
        if llm is not None:
            llm.close()
    return 0
