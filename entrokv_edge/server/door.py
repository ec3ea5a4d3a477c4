"""The door in front of llama-cpp-python's app: admission (a bounded queue, 503 beyond it), request checks
(422 / 400 with OpenAI-style errors instead of a 500 with a traceback), and the KV report put back into a
non-streaming answer."""
from __future__ import annotations

import contextvars
import json
import sys
import traceback

from pydantic import ValidationError

# the report of the request being served, for _Door to put into a non-streaming answer; a
# ContextVar because the route runs the model in a worker thread, which gets a copy of the context
REPORT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("entrokv_report", default=None)


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
            token = REPORT.set(reply.report)
            try:
                await self.app(scope, receive_again, reply.send)
            except Exception as e:      # an answer must end cleanly, never as a cut connection
                await reply.fail(e)
            else:
                await reply.close()
            finally:
                REPORT.reset(token)
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
