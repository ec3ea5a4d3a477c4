"""entrokv-edge serve: a real server process on 127.0.0.1, driven by the real openai client."""
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

MODEL = "smollm2-135m"
SERVE = ["--kv-cells", 512, "--budget", 128, "--threads", 1, "--conversations", 4, "--queue", 2]
REPORT = {"logical_tokens", "kept_tokens", "kv_cells", "kv_bytes_full", "kv_bytes_kept", "evictions", "evaluated_tokens",
          "store_bytes", "store_bytes_in_memory", "queued_s", "first_token_s", "seconds"}
TOPICS = ["bees", "trains", "tides", "comets", "ferns", "owls", "glaciers", "violins"]


class Server:
    """``python -m entrokv_edge serve`` on a free port (--port 0; the URL is read from stderr)."""

    def __init__(self, model, *args):
        cmd = [sys.executable, "-m", "entrokv_edge", "serve", "-m", str(model), "--port", "0", *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        lines: queue.Queue = queue.Queue()

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                lines.put(line)
            lines.put(None)
        threading.Thread(target=drain, daemon=True).start()
        line = lines.get(timeout=300)
        m = re.search(r"http://[^/\s]+:(\d+)/v1", line or "")
        if m is None:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {''.join(self.log)}")
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", **kw)

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=300) as r:
            return json.loads(r.read())

    def post(self, path, body: bytes):
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))

    def stop(self, sig=signal.SIGTERM, timeout=15) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


@pytest.fixture(scope="module")
def server(smollm2):                     # smollm2: fetched; served by its registered name
    s = Server(MODEL, *SERVE)
    yield s
    if s.proc.poll() is None:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(max_retries=0)


def chat(client, messages, max_tokens=16, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def turn(client, conversation, text, max_tokens=16):
    conversation.append({"role": "user", "content": text})
    r = chat(client, conversation, max_tokens)
    conversation.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


def notes(topic, n=12):
    return " ".join(f"Note {i} about {topic}: the {topic} in field {i} were counted on day {3 * i + 1}." for i in range(n))


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_streaming_equals_non_streaming_and_both_report_the_kv(client):
    msgs = [{"role": "user", "content": "List three fruits and the colour of each."}]
    full = chat(client, msgs, 24)
    rep = full.model_extra["entrokv"]
    assert set(rep) == REPORT and rep["kv_cells"] == 512
    assert rep["logical_tokens"] in (full.usage.total_tokens - 1, full.usage.total_tokens)
    assert rep["kept_tokens"] == rep["logical_tokens"] and rep["kv_bytes_kept"] == rep["kv_bytes_full"] > 0
    chunks = list(chat(client, msgs, 24, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text.strip()
    reported = [c for c in chunks if "entrokv" in (c.model_extra or {})]
    assert reported == [chunks[-1]] and chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].model_extra["entrokv"]["logical_tokens"] == rep["logical_tokens"]


def test_completions_streaming_equals_non_streaming_and_both_report_the_kv(client):
    kw = dict(model="any-name-is-served-by-the-one-model", prompt="The three primary colours are", max_tokens=12,
              temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text != ""
    assert set(full.model_extra["entrokv"]) == REPORT and set(chunks[-1].model_extra["entrokv"]) == REPORT
    assert all("entrokv" not in (c.model_extra or {}) for c in chunks[:-1])


def test_interleaved_conversations_continue_from_their_saved_states(server, client):
    """A, B, A, B: A's second turn loads A's compressed state from the conversation cache and
    evaluates only its new tokens, and answers as a fresh Python run of A alone does."""
    a, b = [], []
    a1 = turn(client, a, notes("bees") + " Which insects are these notes about?")
    b1 = turn(client, b, notes("trains") + " Which machines are these notes about?")
    a2 = turn(client, a, "How many notes were there?")
    b2 = turn(client, b, "On which day was field 2 counted?")
    for first, second in ((a1, a2), (b1, b2)):
        new = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
        evaluated = second.model_extra["entrokv"]["evaluated_tokens"]
        assert new < 40 < first.usage.prompt_tokens
        assert evaluated <= new + second.usage.completion_tokens + 1      # the history was not read again
    stats = server.get("/entrokv/stats")["conversations"]
    assert 2 <= stats["conversations"] <= 4 and 0 < stats["bytes"] <= stats["max_bytes"]
    from entrokv_edge import cli, launch
    ref = launch.load_runtime(cli._parser().parse_args(["serve", "-m", MODEL, *map(str, SERVE)]), None)
    try:
        for n, answer in ((1, a1), (3, a2)):      # the server's default repeat_penalty, in Python
            out = ref.create_chat_completion(a[:n], max_tokens=16, temperature=0, repeat_penalty=1.1)
            assert out["choices"][0]["message"]["content"] == answer.choices[0].message.content
    finally:
        ref.close()


def test_a_conversation_longer_than_the_cache(client):
    conv, reports, prev = [], [], None
    for topic in ("comets", "ferns", "glaciers"):
        r = turn(client, conv, notes(topic, 16) + " What were these notes about?")
        assert r.choices[0].message.content.strip()
        reports.append(r.model_extra["entrokv"])
        if prev is not None:       # each turn goes on from the compressed cache: only its new tokens
            new = r.usage.prompt_tokens - prev.usage.total_tokens
            assert reports[-1]["evaluated_tokens"] <= new + r.usage.completion_tokens + 1
        prev = r
    last = reports[-1]
    assert last["logical_tokens"] > 2 * 512 and last["kept_tokens"] <= 512 and last["kv_cells"] == 512
    assert last["evictions"] > reports[0]["evictions"] and last["kv_bytes_kept"] < last["kv_bytes_full"] / 2


def test_bad_requests_get_a_clean_4xx_and_the_server_goes_on(server, client):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        chat(client, [])
    assert "messages" in e.value.body["message"]
    for body in (b'{"messages": "hello"}', b"not json"):
        status, err = server.post("/v1/chat/completions", body)
        assert status == 422 and err["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        chat(client, [{"role": "user", "content": "hi"}], logprobs=True)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, logprobs=2)
    too_long = [{"role": "user", "content": "word " * 9000}]     # above the model's 8192-token context
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, too_long)
    assert e.value.body["code"] == "context_length_exceeded" and "8192" in e.value.body["message"]
    with pytest.raises(openai.APIError) as e:                   # streaming: an error event, not a cut connection
        list(chat(client, too_long, stream=True))
    assert e.value.body["code"] == "context_length_exceeded" and "8192" in e.value.message
    assert chat(client, [{"role": "user", "content": "Say hello."}], 4).choices[0].message.content
    assert not any("Traceback" in line for line in server.log), "".join(server.log)


def test_a_client_gone_mid_stream_does_not_hold_the_model(client):
    stream = chat(client, [{"role": "user", "content": "Tell me a long story about a dragon."}], 400, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    r = chat(client, [{"role": "user", "content": "Say hello."}], 4)
    assert r.choices[0].message.content and r.model_extra["entrokv"]["evaluated_tokens"] > 0


def test_concurrent_clients_are_answered_or_refused_and_memory_stays_flat(server):
    """6 clients at once, 8 times, each its own conversation: every request answered (200) or
    refused (503, --queue 2: one generating, two waiting), the server alive, the saved states
    bounded, RSS flat. RSS moves by up to ~30 MiB as glibc's per-thread arenas keep freed
    blocks; a leak of a state-sized buffer (~12 MB here) per answer would add > 100 MiB."""
    def burst(round_):
        barrier, out = threading.Barrier(6), [None] * 6

        def one(i):
            c = server.client(max_retries=0, timeout=300)
            barrier.wait()
            try:
                msg = f"{notes(TOPICS[(i + round_) % 8], 4)} Round {round_}, client {i}: what is this about?"
                out[i] = (200, chat(c, [{"role": "user", "content": msg}], 8).choices[0].message.content)
            except openai.APIStatusError as e:
                out[i] = (e.status_code, e.body)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out
    results, rss = [], []
    for round_ in range(8):                 # rounds 0-1 warm up, 2-4 and 5-7 are compared
        results += burst(round_)
        rss.append(server.rss_kib())
    assert {s for s, _ in results} <= {200, 503}
    answered = [x for s, x in results if s == 200]
    refused = [x for s, x in results if s == 503]
    assert len(answered) >= 8 and all(answered) and refused
    assert all(x["code"] == "busy" and "retry" in x["message"] for x in refused)
    for _ in range(100):               # the last request leaves the door just after its answer went out
        stats = server.get("/entrokv/stats")
        if stats["requests"]["active"] == 0:
            break
        time.sleep(0.05)
    assert stats["requests"]["active"] == 0 and stats["requests"]["refused"] >= len(refused)
    assert stats["conversations"]["conversations"] == 4           # bounded: the 4 most recent of them
    print(f"RSS MiB per burst {[r // 1024 for r in rss]}; {len(answered)} answered, {len(refused)} refused; "
          f"{stats['conversations']}")
    assert rss[7] - rss[4] < 48 * 1024, rss


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_server_with_status_0_and_frees_the_port(smollm2, sig):
    s = Server(smollm2, "--kv-cells", 256, "--budget", 64, "--threads", 1)
    c = s.client(max_retries=0)
    stream = iter(chat(c, [{"role": "user", "content": "Tell me a long story."}], 200, stream=True))
    next(stream)                                                # a stream in flight
    t0 = time.monotonic()
    assert s.stop(sig) == 0 and time.monotonic() - t0 < 10
    try:
        list(stream)                    # the stream ends, early or not, without hanging
    except openai.APIError:
        pass
    with pytest.raises(openai.APIConnectionError):
        chat(c, [{"role": "user", "content": "hi"}], 2)
    with socket.socket() as sock:       # nothing listens there any more: a new server can bind it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", s.port))
        sock.listen()
    assert not any("Traceback" in line for line in s.log), "".join(s.log)


def serve_cli(*args, env=None):
    r = subprocess.run([sys.executable, "-m", "entrokv_edge", "serve", *map(str, args)], capture_output=True,
                       text=True, timeout=300, env=env)
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("case", ["missing model", "busy port", "bad port", "budget above cache", "no server extra",
                                  "memory nan", "queue negative"])
def test_bad_serve_input_is_one_clear_line(smollm2, tmp_path, case):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = {"missing model": ["-m", tmp_path / "nope.gguf"],
                "busy port": ["-m", smollm2, "--port", busy.getsockname()[1]],
                "bad port": ["-m", smollm2, "--port", 70000],
                "budget above cache": ["-m", smollm2, "--port", 0, "--kv-cells", 512, "--budget", 1000],
                "no server extra": ["-m", smollm2, "--port", 0],
                "memory nan": ["-m", smollm2, "--port", 0, "--conversations-mib", "nan"],
                "queue negative": ["-m", smollm2, "--port", 0, "--queue", -1]}[case]
        env = None
        if case == "no server extra":       # an install without the extra: fastapi cannot be imported
            (tmp_path / "fastapi").mkdir()
            (tmp_path / "fastapi" / "__init__.py").write_text("raise ImportError('no fastapi', name='fastapi')\n")
            env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        rc, out, err = serve_cli(*args, env=env)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith("entrokv-edge: "), err
    want = {"missing model": "nope.gguf", "busy port": "cannot listen", "bad port": "--port",
            "budget above cache": "budget of 1000 tokens", "no server extra": 'pip install -e ".[server]"',
            "memory nan": "--conversations-mib: expected a finite number", "queue negative": "--queue: must be"}[case]
    assert want in lines[0]


def test_the_conversation_cache_keeps_one_state_per_conversation_within_its_bounds(synth_models):
    import entrokv_edge as ek
    from entrokv_edge.server.app import ConversationCache
    llm = ek.EntroKVLlama(str(synth_models["llama-r3"]), n_ctx=256, budget=64, page_size=8, window=16,
                          verbose=False, seed=0, n_threads=1, n_threads_batch=1)

    def state(tokens):
        llm.reset()
        llm.eval(tokens)
        return llm.save_state()
    a, b, c = ([t] * 5 + list(range(10, 130)) for t in (3, 4, 5))
    a2 = a + [7] * 20                                       # a's next turn
    sa, sa2, sb, sc = state(a), state(a2), state(b), state(c)
    assert sa.scores.shape[0] == 0 and sa2.nbytes > sa.nbytes   # (no path here reads the scores)
    cache = ConversationCache(max_states=2, capacity_bytes=1 << 30)
    cache[a] = sa
    cache[a2] = sa2
    assert cache.stats()["conversations"] == 1 and cache[a + [1]] is sa2 and cache[a2 + [1]] is sa2
    cache[b] = sb
    assert cache[a2 + [2]] is sa2                           # a used again: b is now the least recent
    cache[c] = sc
    assert list(cache.cache_state.values()) == [sa2, sc]
    assert cache.stats() == {"conversations": 2, "bytes": sa2.nbytes + sc.nbytes, "max_conversations": 2,
                             "max_bytes": 1 << 30, "hits": 0, "evicted": 1}     # (no runtime given: no hit counted)
    by_bytes = ConversationCache(max_states=8, capacity_bytes=sb.nbytes + sc.nbytes)
    for key, s in ((a2, sa2), (b, sb), (c, sc)):
        by_bytes[key] = s
    assert list(by_bytes.cache_state.values()) == [sb, sc]
    too_small = ConversationCache(max_states=8, capacity_bytes=sa.nbytes - 1)
    too_small[a] = sa
    assert too_small.stats()["conversations"] == 0 and bool(too_small)   # still used by llama-cpp-python
    llm.close()
