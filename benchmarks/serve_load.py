"""A bounded load run of ``entrokv-edge serve`` on 127.0.0.1: several clients at once, long documents,
follow-up turns, streaming and not, and clients that disconnect; then every answered conversation replayed
alone on a fresh server, which must give the same answers (nothing lost or mixed between conversations).

    python benchmarks/serve_load.py [--model smollm2-135m] [--clients 8] [--requests 240] [--minutes 30]
        [--kv-cells 1024] [--out benchmarks/results/serve_load.json]

Each client runs conversations one after another: a document (a stretch of the essays, 600-1500 tokens)
with a first question, then 2-4 follow-up questions, each with up to 48 tokens of answer, half of them
streamed, every eighth a stream the client drops after a few events (it then asks that turn again, as a
user would, so its conversation goes on from the turn before); a 503 is retried after a pause. It stops
after ``--requests`` requests or ``--minutes``. Reported: requests answered / refused (503) / failed /
dropped on purpose; time to first token (the client's, the queue included, and the server's, from the model
taken: its ``entrokv.first_token_s``) p50 / p95 for first and follow-up turns; tokens per second; the server's
RSS sampled every second and its slope after the warm-up (first quarter of the run), in MiB per minute;
then the replay: every conversation whose turns were all answered, asked turn by turn on a fresh server with
one client, its answers compared with the load run's (temperature 0).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

QUESTIONS = ["What is the main point of the text above?", "Name one example the author gives.",
             "Summarize the last paragraph in one sentence.", "Which claim in the text do you find weakest?",
             "What would the author say about startups?", "Give the text a title."]


class Served:
    """``python -m entrokv_edge serve`` on a free port; the URL is read from its ready line."""

    def __init__(self, model: str, *args):
        cmd = [sys.executable, "-m", "entrokv_edge", "serve", "-m", model, "--port", "0", *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        ready = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"http://[^/\s]+:(\d+)/v1", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()
        threading.Thread(target=drain, daemon=True).start()
        ready.wait(600)
        if not hasattr(self, "port"):
            raise SystemExit(f"the server did not start: {''.join(self.log)}")
        self.url = f"http://127.0.0.1:{self.port}"

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _post(port: int, body: dict, stream: bool, drop_after: int | None = None, timeout=600) -> dict:
    """One request over raw HTTP: {status, text, ttft (client), entrokv, tokens, dropped}."""
    raw = json.dumps({**body, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    t0 = time.perf_counter()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n".encode() + raw)
    buf, ttft, events = b"", None, 0
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            if ttft is None and (b"data: {" in buf + chunk or not stream):
                ttft = time.perf_counter() - t0
            buf += chunk
            events = buf.count(b"data: {")
            if drop_after is not None and events >= drop_after:
                return {"status": 200, "dropped": True, "events": events}
    finally:
        sock.close()
    head, _, payload = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    out = {"status": status, "ttft": ttft, "seconds": time.perf_counter() - t0, "dropped": False}
    if status != 200:
        return out
    if not stream:
        if b"transfer-encoding: chunked" in head.lower():
            payload = _unchunk(payload)
        data = json.loads(payload)
        out.update(text=data["choices"][0]["message"]["content"] or "", entrokv=data.get("entrokv", {}),
                   tokens=data["usage"]["completion_tokens"])
        return out
    text, rep, n = [], {}, 0
    for line in _unchunk(payload).split(b"\n") if b"transfer-encoding: chunked" in head.lower() else payload.split(b"\n"):
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            if "error" in ev:
                return {**out, "status": 500, "error": ev["error"]}
            d = ev["choices"][0].get("delta", {}) if ev.get("choices") else {}
            if d.get("content"):
                text.append(d["content"])
                n += 1
            rep = ev.get("entrokv", rep)
    out.update(text="".join(text), entrokv=rep, tokens=n)
    return out


def _unchunk(b: bytes) -> bytes:
    out, i = b"", 0
    while i < len(b):
        j = b.find(b"\r\n", i)
        if j < 0:
            break
        size = int(b[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += b[j + 2: j + 2 + size]
        i = j + 2 + size + 2
    return out


def documents(model: str, n: int, rng: random.Random) -> list[str]:
    import entrokv_edge as ek
    import _harness as H
    vocab = ek.llama_cpp.Llama(str(ek.models.model_path(model)), vocab_only=True, verbose=False)
    toks = vocab.tokenize(b" ".join(f.read_bytes() for f in H.essays()))
    out = []
    for _ in range(n):
        length = rng.randrange(600, 1500)
        at = rng.randrange(0, len(toks) - length)
        out.append(vocab.detokenize(toks[at: at + length]).decode("utf-8", errors="replace"))
    return out


def load_run(port: int, model: str, clients: int, requests: int, minutes: float, seed: int, served: Served) -> dict:
    rng = random.Random(seed)
    docs = documents(model, 64, rng)
    lock, stop = threading.Lock(), threading.Event()
    log: list[dict] = []          # every request
    convs: list[dict] = []        # every conversation: its messages and answers
    counter = {"sent": 0}
    t_end = time.time() + 60 * minutes

    def ask(c: int, k: int, msgs: list[dict], r: random.Random) -> dict | None:
        """One turn, retried after a 503 and asked again after a drop; None once the run is over."""
        while True:
            with lock:
                if counter["sent"] >= requests or time.time() > t_end:
                    stop.set()
                    return None
                counter["sent"] += 1
                n_req = counter["sent"]
            stream = r.random() < 0.5
            drop = 3 if (stream and n_req % 8 == 0) else None
            body = {"model": model, "messages": msgs, "max_tokens": 48, "temperature": 0, "seed": 0}
            try:
                res = _post(port, body, stream, drop)
            except OSError as e:
                res = {"status": 0, "error": str(e), "dropped": False}
            rep = res.get("entrokv") or {}
            with lock:
                log.append({"t": time.time(), "client": c, "turn": k, "stream": stream,
                            **{x: res.get(x) for x in ("status", "ttft", "seconds", "tokens", "dropped")},
                            "server_first_token_s": rep.get("first_token_s"), "queued_s": rep.get("queued_s")})
            if res.get("dropped"):
                continue                 # asked again, as a user would after a dropped answer
            if res["status"] == 503:
                time.sleep(0.5 + r.random())
                continue
            return res

    def client(c: int):
        r = random.Random(seed * 1000 + c)
        while not stop.is_set():
            conv = {"client": c, "turns": [], "complete": True}
            msgs = [{"role": "user", "content": r.choice(docs) + "\n\n" + r.choice(QUESTIONS)}]
            for k in range(1 + r.randrange(2, 5)):
                if k:
                    msgs.append({"role": "user", "content": r.choice(QUESTIONS)})
                res = ask(c, k, msgs, r)
                if res is None or res["status"] != 200:
                    conv["complete"] = False
                    break
                conv["turns"].append({"messages": [dict(m) for m in msgs], "answer": res["text"]})
                msgs.append({"role": "assistant", "content": res["text"]})
            with lock:
                convs.append(conv)

    rss = []

    def sample():
        t0 = time.time()
        while not stop.is_set():
            rss.append((time.time() - t0, served.rss_mib()))
            time.sleep(1.0)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.time()
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"log": log, "conversations": convs, "rss": rss, "wall_s": time.time() - t0}


def replay(port: int, model: str, convs: list[dict]) -> dict:
    """Every conversation whose turns were answered, alone on a fresh server: its answers, turn by turn."""
    same = differ = 0
    diffs = []
    for conv in convs:
        for t in conv["turns"]:
            res = _post(port, {"model": model, "messages": t["messages"], "max_tokens": 48, "temperature": 0,
                               "seed": 0}, stream=False)
            if res.get("text") == t["answer"]:
                same += 1
            else:
                differ += 1
                diffs.append({"client": conv["client"], "turn": len(t["messages"]) // 2,
                              "load": t["answer"][:80], "alone": (res.get("text") or "")[:80]})
    return {"turns_same": same, "turns_differ": differ, "diffs": diffs[:20]}


def _pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


def summary(run: dict, rep: dict) -> dict:
    log = run["log"]
    answered = [r for r in log if r["status"] == 200 and not r["dropped"]]
    out = {"requests": len(log), "answered": len(answered), "refused_503": sum(r["status"] == 503 for r in log),
           "failed": sum(r["status"] not in (200, 503) for r in log), "dropped_on_purpose": sum(bool(r["dropped"]) for r in log),
           "wall_s": run["wall_s"]}
    for name, turns in (("first", [r for r in answered if r["turn"] == 0]),
                        ("followup", [r for r in answered if r["turn"] > 0])):
        c = [r["ttft"] for r in turns if r["ttft"] is not None]
        s = [r["server_first_token_s"] for r in turns if r["server_first_token_s"] is not None]
        out[f"ttft_{name}_client_p50_s"], out[f"ttft_{name}_client_p95_s"] = _pct(c, 50), _pct(c, 95)
        out[f"ttft_{name}_server_p50_s"], out[f"ttft_{name}_server_p95_s"] = _pct(s, 50), _pct(s, 95)
    tps = [r["tokens"] / r["seconds"] for r in answered if r.get("tokens") and r.get("seconds")]
    out["tokens_per_s_p50"] = _pct(tps, 50)
    t = np.array([x for x, _ in run["rss"]])
    m = np.array([y for _, y in run["rss"]])
    keep = t >= t.max() / 4 if t.size else t
    out["rss_mib_start"], out["rss_mib_max"] = (float(m[0]), float(m.max())) if m.size else (None, None)
    out["rss_slope_mib_per_min"] = float(np.polyfit(t[keep] / 60, m[keep], 1)[0]) if keep.sum() > 2 else None
    out["rss_slope_noise_mib"] = float(np.std(m[keep])) if keep.sum() > 2 else None
    out.update(rep)
    return out


def main(argv=None) -> int:
    import evidence
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--kv-cells", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "serve_load.json"))
    args = ap.parse_args(argv)
    common = ["--kv-cells", args.kv_cells, "--threads", args.threads, "--conversations", args.clients * 2]
    commit, t0 = evidence.commit_id(), time.time()
    s = Served(args.model, *common, "--queue", args.clients)
    try:
        run = load_run(s.port, args.model, args.clients, args.requests, args.minutes, args.seed, s)
    finally:
        s.stop()
    alone = Served(args.model, *common)
    try:
        rep = replay(alone.port, args.model, [c for c in run["conversations"] if c["turns"]])
    finally:
        alone.stop()
    out = summary(run, rep)
    print(json.dumps(out, indent=1))
    settings = {**vars(args), "questions": QUESTIONS}
    doc = {"meta": evidence.meta("full", settings, time.time() - t0, commit), "data": {"summary": out,
           "requests": run["log"], "rss": run["rss"]}}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
