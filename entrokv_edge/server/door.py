"""The door in front of llama-cpp-python's app, the server's outermost ASGI application: the API key on
every route, ``GET /health`` and ``GET /metrics``, 503 while the model loads, admission (a bounded queue,
503 beyond it), request limits and checks (413 / 400 / 422 with OpenAI-style errors instead of a 500 with a
traceback), a watch on each generating request's client (a disconnect stops its generation within a token
or two), and the KV report put back into a non-streaming answer."""
from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import sys
import threading
import time
import traceback

from pydantic import ValidationError

from .metrics import Metrics

# the report of the request being served, for _Door to put into a non-streaming answer, and the flag its
# client's disconnect sets; ContextVars because the route runs the model in a worker thread, which gets a copy
REPORT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("entrokv_report", default=None)
GONE: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("entrokv_gone", default=None)
ADMITTED: contextvars.ContextVar[float | None] = contextvars.ContextVar("entrokv_admitted", default=None)

def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> tuple[int, dict]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _send_json(send, status: int, body: dict, extra: list | None = None) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *(extra or [])]})
    await send({"type": "http.response.body", "body": raw})


def _check(body: bytes, model, max_tokens_cap: int | None = None) -> tuple[tuple[int, dict] | None, bytes]:
    """What is wrong with a request body, as (status, OpenAI-style error) or None, and the body to serve
    (``max_tokens`` set to the cap where the request gives none)."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        return _error(422, f"{where}: {err['msg']}", where), body
    if getattr(req, "messages", None) == []:        # llama-cpp-python's request model defaults it to []
        return _error(422, "messages: at least one message is required", "messages"), body
    if (req.logprobs is not None and req.logprobs is not False) or getattr(req, "top_logprobs", None):
        return _error(400, "logprobs are not available: the cache holds fewer tokens than the conversation, "
                           "so there are no per-token logits to report", "logprobs"), body
    if max_tokens_cap is not None:
        given = req.max_tokens
        if given is not None and given > max_tokens_cap:
            return _error(400, f"max_tokens {given} is above this server's cap of {max_tokens_cap} "
                               "(--max-tokens-cap)", "max_tokens"), body
        if given is None or given <= 0:      # none (or "until the model stops"): the cap
            data = json.loads(body)
            data["max_tokens"] = max_tokens_cap
            body = json.dumps(data).encode()
    return None, body


class Door:
    """The server's ASGI application: ``app`` (llama-cpp-python's, once the model is loaded; None before).

    Every HTTP request must carry one of ``keys`` as ``Authorization: Bearer KEY`` (401 otherwise; no keys:
    none asked). ``GET /health``: 200 once the model is loaded, 503 while it loads. ``GET /metrics``:
    Prometheus text. Anything else while loading: 503. On the generating routes (``routes``: path -> request
    model): at most ``limit`` requests at a time (one generating, the rest waiting for llama-cpp-python's
    model lock), one more gets a 503; a body over ``max_body`` bytes a 413; ``max_tokens`` above
    ``max_tokens_cap`` a 400 (and the cap where none is given); a body llama-cpp-python's own request models
    refuse a 422 (its route handler would answer 500 with a traceback), logprobs a 400. While such a request
    runs, its client is watched: a disconnect sets GONE, which stops the generation (app.py). The ``entrokv``
    field the response model dropped goes back into a JSON answer."""

    def __init__(self, routes: dict, queue: int, keys: list[str] | None = None, max_body: int = 8 << 20,
                 max_tokens_cap: int | None = None):
        self.app, self.llm, self.conversations = None, None, None
        self.routes, self.keys = routes, [k.encode() for k in (keys or [])]
        self.max_body, self.max_tokens_cap = max_body, max_tokens_cap
        self.counters = {"limit": queue + 1, "active": 0, "refused": 0}
        self.metrics = Metrics()

    def ready(self, app, llm, conversations) -> None:
        """The model is loaded: serve ``app``."""
        self.llm, self.conversations, self.app = llm, conversations, app

    def _authorized(self, scope) -> bool:
        if not self.keys:
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        given = given.strip()
        ok = False
        for k in self.keys:                      # every key compared, in constant time
            ok |= hmac.compare_digest(given, k)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":              # websockets: none served
            return None
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if not self._authorized(scope):
            self.metrics.answered(path, 401)
            return await _send_json(send, *_error(401, "a valid API key is required: send it as 'Authorization: "
                                                       "Bearer KEY'", code="invalid_api_key"),
                                    extra=[(b"www-authenticate", b"Bearer")])
        if path == "/health" and method == "GET":
            status = 200 if self.app is not None else 503
            self.metrics.answered(path, status)
            return await _send_json(send, status, {"status": "ok" if status == 200 else "loading"})
        if path == "/metrics" and method == "GET":
            self.metrics.answered(path, 200)
            stats = self.conversations.stats() if self.conversations is not None else None
            text = self.metrics.render(self.app is not None, self.counters, self.llm, stats).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                                    (b"content-length", str(len(text)).encode())]})
            return await send({"type": "http.response.body", "body": text})
        if self.app is None:
            self.metrics.answered(path, 503)
            return await _send_json(send, *_error(503, "the model is loading; GET /health answers 200 once it is "
                                                       "loaded", code="loading"))
        model = self.routes.get(path) if method == "POST" else None
        if model is None:
            status = {}

            async def counted(msg):
                if msg["type"] == "http.response.start":
                    status["code"] = msg["status"]
                await send(msg)
            try:
                return await self.app(scope, receive, counted)
            finally:
                self.metrics.answered(path, status.get("code", 500))
        return await self._generate(scope, receive, send, model, path)

    async def _generate(self, scope, receive, send, model, path):
        c = self.counters
        if c["active"] >= c["limit"]:
            c["refused"] += 1
            self.metrics.add(refused_busy=1)
            self.metrics.answered(path, 503)
            return await _send_json(send, *_error(503, f"busy: {c['limit']} requests are in the server already "
                                                       "(one generates, the others wait); retry later", code="busy"))
        c["active"] += 1
        t_admitted = ADMITTED.set(time.perf_counter())
        reply = _Reply(send, path, self.metrics)
        try:
            body, more = b"", True
            while more:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body, more = body + msg.get("body", b""), msg.get("more_body", False)
                if len(body) > self.max_body:
                    return await reply.refuse(*_error(413, f"the request body is larger than this server takes "
                                                            f"({self.max_body} bytes: --max-body-kib)", code="too_large"))
            refusal, body = _check(body, model, self.max_tokens_cap)
            if refusal is not None:
                return await reply.refuse(*refusal)
            gone = threading.Event()
            inbox: asyncio.Queue = asyncio.Queue()

            async def watch():                   # the real receive, read on: a disconnect sets the flag
                while True:
                    m = await receive()
                    if m["type"] == "http.disconnect":
                        gone.set()
                    await inbox.put(m)
                    if m["type"] == "http.disconnect":
                        return
            watcher = asyncio.ensure_future(watch())
            replay = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive_again():
                return replay.pop() if replay else await inbox.get()
            t_report, t_gone = REPORT.set(reply.report), GONE.set(gone)
            try:
                await self.app(scope, receive_again, reply.send)
            except Exception as e:      # an answer must end cleanly, never as a cut connection
                await reply.fail(e)
            else:
                await reply.close()
            finally:
                REPORT.reset(t_report)
                GONE.reset(t_gone)
                watcher.cancel()
                if gone.is_set():
                    self.metrics.add(cancelled=1)
        finally:
            c["active"] -= 1
            ADMITTED.reset(t_admitted)
            reply.count()


async def _lifespan(receive, send) -> None:
    """ASGI lifespan: nothing to start or stop (the model's life is the command's)."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            return await send({"type": "lifespan.shutdown.complete"})


class _Reply:
    """The answer to one admitted request, on its way out: a successful JSON answer gets
    ``report["entrokv"]`` (an event stream's final chunk carries it already); an error raised
    inside the app becomes a 500 JSON error if nothing was sent yet, else (a stream, whose status
    went out with its first byte) an OpenAI error event, on which the openai client raises APIError."""

    def __init__(self, send, path: str = "", metrics: Metrics | None = None):
        self._send, self.report = send, {}
        self.started = self.finished = self.streaming = False
        self._held, self._parts, self._end = None, [], None
        self.path, self.metrics, self.status = path, metrics, None

    def count(self) -> None:
        """The answer's status into the metrics (once it has one: a client gone before any byte, none)."""
        if self.metrics is not None and self.status is not None:
            self.metrics.answered(self.path, self.status)

    async def refuse(self, status: int, body: dict) -> None:
        self.status = status
        await _send_json(self._send, status, body)

    async def send(self, msg):
        if msg["type"] == "http.response.start":
            self.started = True
            self.status = msg["status"]
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
            self.status = status
            return await _send_json(self._send, status, body)
        if self.streaming:
            event = b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
            await self._send({"type": "http.response.body", "body": event, "more_body": False})
