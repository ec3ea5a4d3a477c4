"""entrokv-edge serve as something left running: the API key on every route, /health and /metrics, request
limits, a disconnected client freeing the model, and the refusal to serve beyond loopback without a key.
Real server processes on 127.0.0.1, the real openai client and raw HTTP."""
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from test_server import MODEL, Server, serve_cli

KEYS = ["k-first-0123456789", "k-second-abcdef"]
ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                                        "messages": [{"role": "user", "content": "hi"}]}),
          ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
          ("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/entrokv/stats", None), ("GET", "/docs", None)]
STORY = [{"role": "user", "content": "Tell me a long story about a dragon who guards a library."}]


def request(port, method, path, body=None, key=None, timeout=300):
    """(status, headers, body bytes) of one raw HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    r = conn.getresponse()
    out = (r.status, dict(r.getheaders()), r.read())
    conn.close()
    return out


def metrics(port, key=None) -> dict:
    """The /metrics samples: {'name{labels}': value}."""
    status, _, body = request(port, "GET", "/metrics", key=key)
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def keyed(smollm2, tmp_path_factory):
    f = tmp_path_factory.mktemp("keys") / "keys.txt"
    f.write_text(f"# the server's keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    s = Server(MODEL, "--kv-cells", 512, "--threads", 1, "--api-key-file", f, "--max-tokens-cap", 64,
               "--max-body-kib", 64)
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_every_route_asks_for_a_key(keyed):
    for method, path, body in ROUTES:
        for key in (None, "wrong-key", KEYS[0][:-1]):
            status, headers, raw = request(keyed.port, method, path, body, key)
            assert status == 401, (path, key, status)
            err = json.loads(raw)["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error", err
            assert headers.get("www-authenticate") == "Bearer"
        for key in KEYS:                       # either key of the file
            status, _, raw = request(keyed.port, method, path, body, key)
            assert status == 200, (path, status, raw[:200])
    assert not any(k in "".join(keyed.log) for k in KEYS)          # the keys never reach the log


def test_the_openai_client_with_and_without_the_key(keyed):
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[1], max_retries=0)
    r = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4,
                                     temperature=0)
    assert r.choices[0].message.content and "entrokv" in r.model_extra
    assert not any(k in "".join(keyed.log) for k in KEYS)


def test_request_limits_are_clear_4xx(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[0], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens 65 is above this server's cap of 64"):
        good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=65)
    status, _, raw = request(keyed.port, "POST", "/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "user", "content": "x" * (70 << 10)}]}, KEYS[0])
    assert status == 413 and json.loads(raw)["error"]["code"] == "too_large"
    # none asked: the cap (the answer stops there at the latest)
    r = good.chat.completions.create(model=MODEL, messages=STORY, temperature=0)
    assert r.usage.completion_tokens <= 64
    m = metrics(keyed.port, KEYS[0])
    assert m['entrokv_requests_total{route="/v1/chat/completions",status="400"}'] >= 1
    assert m['entrokv_requests_total{route="/v1/chat/completions",status="413"}'] >= 1


def test_metrics_count_requests_tokens_and_the_kv(keyed):
    before = metrics(keyed.port, KEYS[0])
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[0], max_retries=0)
    r = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                     max_tokens=8, temperature=0)
    after = metrics(keyed.port, KEYS[0])
    ok = 'entrokv_requests_total{route="/v1/chat/completions",status="200"}'
    assert after[ok] == before.get(ok, 0) + 1
    assert after["entrokv_generated_tokens_total"] - before["entrokv_generated_tokens_total"] == \
        r.usage.completion_tokens
    assert after["entrokv_prompt_tokens_total"] > before["entrokv_prompt_tokens_total"]
    assert after["entrokv_ready"] == 1 and after["entrokv_queue_depth"] == 0 and after["entrokv_queue_limit"] >= 1
    assert after["entrokv_kv_bytes_held"] <= after["entrokv_kv_bytes_allocated"] and after["entrokv_kv_bytes_full"] > 0
    for name in ("entrokv_evictions_total", 'entrokv_store_bytes{where="memory"}', "entrokv_conversations",
                 "entrokv_conversation_hits_total", "entrokv_conversation_evictions_total", "entrokv_cancelled_total"):
        assert name in after, name


@pytest.fixture(scope="module")
def plain(smollm2):
    s = Server(MODEL, "--kv-cells", 512, "--threads", 1)
    yield s
    if s.proc.poll() is None:
        s.stop()


def _gone_mid_stream(port, body, after_chunks: int) -> int:
    """Stream ``body``, read ``after_chunks`` events of it, then close the connection; the events read."""
    sock = socket.create_connection(("127.0.0.1", port))
    raw = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    seen, buf = 0, b""
    while seen < after_chunks:
        buf += sock.recv(4096)
        seen = buf.count(b"data: {")
    sock.close()
    return seen


def _idle(port, timeout=120) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = metrics(port)
        if m["entrokv_queue_depth"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError("the server stayed busy")


def test_a_disconnect_frees_the_model_within_five_tokens_and_leaves_the_conversation_as_it_was(plain):
    body = {"model": MODEL, "messages": STORY, "max_tokens": 200, "temperature": 0}
    status, _, raw = request(plain.port, "POST", "/v1/chat/completions", body)     # uninterrupted, as a reference
    assert status == 200
    want = json.loads(raw)["choices"][0]["message"]["content"]
    before = _idle(plain.port)
    read = _gone_mid_stream(plain.port, body, 3)
    m = _idle(plain.port)
    generated = m["entrokv_generated_tokens_total"] - before["entrokv_generated_tokens_total"]
    assert generated <= read + 5, (generated, read)
    assert m["entrokv_cancelled_total"] == before["entrokv_cancelled_total"] + 1
    # the same conversation again: the half answer was not kept, the answer is the uninterrupted one
    status, _, raw = request(plain.port, "POST", "/v1/chat/completions", body)
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == want
    # a request that is not streamed stops too when its client goes
    before = _idle(plain.port)
    sock = socket.create_connection(("127.0.0.1", plain.port))
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    time.sleep(0.5)                              # the generation under way
    sock.close()
    m = _idle(plain.port)
    assert m["entrokv_generated_tokens_total"] - before["entrokv_generated_tokens_total"] < 200
    assert m["entrokv_cancelled_total"] == before["entrokv_cancelled_total"] + 1
    # and the next request starts at once and is answered
    status, _, raw = request(plain.port, "POST", "/v1/chat/completions", {**body, "max_tokens": 4})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"]
    assert not any("Traceback" in line for line in plain.log), "".join(plain.log)


def test_health_answers_503_until_the_model_is_loaded_and_every_other_route_waits():
    """The door on a real uvicorn server before its model is loaded (and once it is 'loaded': a stub app)."""
    import uvicorn
    from entrokv_edge.server.app import ROUTES as R
    from entrokv_edge.server.door import Door
    door = Door(R, queue=2)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(door, log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        for _ in range(200):
            try:
                status, _, raw = request(port, "GET", "/health")
                break
            except OSError:
                time.sleep(0.05)
        assert status == 503 and json.loads(raw) == {"status": "loading"}
        status, _, raw = request(port, "POST", "/v1/chat/completions", {"messages": []})
        assert status == 503 and json.loads(raw)["error"]["code"] == "loading"
        assert metrics(port)["entrokv_ready"] == 0

        async def app(scope, receive, send):      # what build_app hands the door once the model is loaded
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        door.ready(app, None, None)
        status, _, _ = request(port, "GET", "/health")
        assert status == 200 and metrics(port)["entrokv_ready"] == 1
        assert request(port, "GET", "/v1/models")[0] == 204
    finally:
        server.should_exit = True
        t.join(timeout=10)


def test_beyond_loopback_without_a_key_is_refused_unless_asked(smollm2, tmp_path):
    rc, out, err = serve_cli("-m", smollm2, "--host", "0.0.0.0", "--port", 0)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "--api-key" in lines[0] and "--no-auth" in lines[0], err
    (tmp_path / "empty").write_text("# no key here\n\n")
    rc, _, err = serve_cli("-m", smollm2, "--host", "0.0.0.0", "--port", 0, "--api-key-file", tmp_path / "empty")
    assert rc == 2 and "found none" in err
    rc, _, err = serve_cli("-m", smollm2, "--api-key-file", tmp_path / "missing")
    assert rc == 2 and "cannot read --api-key-file" in err
    s = Server(MODEL, "--host", "0.0.0.0", "--no-auth", "--kv-cells", 512, "--threads", 1)
    try:
        assert request(s.port, "GET", "/health")[0] == 200
    finally:
        s.stop()
    help_ = serve_cli("--help")[1]
    assert "Beyond loopback" in help_ and "--api-key" in help_ and "--no-auth" in help_
