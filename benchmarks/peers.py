"""Peer KV-cache-eviction systems (OpenVINO GenAI, kvpress) on the same GGUF model and prompts.

    .venv-peers/bin/python benchmarks/peers.py --gguf MODEL.gguf --in prompts.jsonl --out results.jsonl \
        [--threads 2] [--systems openvino,kvpress-snapkv,kvpress-streaming,kvpress-expected,openvino-full,kvpress-full]
        [--kl]
    .venv-peers/bin/python benchmarks/peers.py --check [--gguf MODEL.gguf] [--out results.jsonl]

Standalone: runs in the peers' venv (benchmarks/peers_env.sh) and does not import entrokv_edge.

Input, one JSON object a line:
    {"id": str, "context": str, "question": str, "budget": float, "placement": "inside"|"after",
     "max_new_tokens": int, ["kl": bool], ["context_ids": [int], "question_ids": [int]]}
budget is the fraction of the context's tokens kept (1.0 = full cache). "inside": the question is
part of the text that is scored and compressed; "after": the context is compressed first and the
question comes after it, uncompressed. "context_ids"/"question_ids" (kvpress only, both or neither):
the token ids of kvpress's "context" and "question" parts, given by the caller instead of kvpress's
own tokenization (pipe.preprocess) of the text, for GGUFs whose tokenizer transformers converts
wrongly (Gemma 3: a Unigram model instead of SentencePiece BPE).

"kl" (or --kl for every case): the kvpress systems also measure KL(full || compressed) along the
full cache's answer, as benchmarks/research/variants.py does for our policies. The reference is greedy
decoding on kvpress's uncompressed cache (same prompt, same placement), up to max_new_tokens tokens,
stopping at EOS / end-of-turn (not included); an empty reference is replaced by its first token
(the stop token), so the first distribution alone is compared. It is computed once per prompt and
shared by every press. Per press: kvpress's own pipeline call (prefill under the press), then the
question part (kvpress's template tail) and the reference's tokens are fed teacher-forced in one
causal forward on the compressed cache, at the positions kvpress's generate_answer uses; log-softmax
(float64) at each of the reference's steps. kl_mean = mean over the steps of
sum_v p_full(v) (log p_full(v) - log p_press(v)), nats; agreement = share of steps whose argmax is
the reference token. OpenVINO GenAI cannot be measured (kl_mean null, kl_note says why).

Output, one JSON object a line per (case, system):
    {"id", "system", "placement", "budget", "answer", "prompt_tokens", "kept_tokens", "kept_note",
     "peak_cache_tokens", "seconds", "threads", "skipped", "note", "versions", ...system extras}
    with "kl": also "kl_mean", "agreement", "reference_answer", "kl_steps", "kl_per_step", "kl_note"
"seconds" is the generation call alone (prefill + decode), not the model load ("load_seconds") nor
the KL measurement ("kl_seconds"; "reference_seconds" once per prompt).
Greedy decoding everywhere, the model's own chat template (a single user turn).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ALL_SYSTEMS = ["openvino", "kvpress-snapkv", "kvpress-streaming", "kvpress-expected", "openvino-full", "kvpress-full"]
DEFAULT_GGUF = Path.home() / ".cache/entrokv-edge/models/SmolLM2-135M-Instruct.Q4_1.gguf"
QA_SEP = "\n\n"  # between context and question, in both placements, so full-cache prompts match


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # OpenVINO puts "Check '...' failed at file:line:" first and the human message after it.
    if len(lines) > 1 and lines[0].startswith("Check '"):
        return f"{type(exc).__name__}: {lines[1].strip()}"
    return f"{type(exc).__name__}: {lines[0] if lines else repr(exc)}"


def versions() -> dict:
    import importlib.metadata as md
    out = {"python": sys.version.split()[0]}
    for name in ["torch", "transformers", "kvpress", "gguf", "openvino", "openvino-genai", "openvino-tokenizers",
                 "numpy"]:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# --------------------------------------------------------------------------------------------- OpenVINO

class OpenVINOSystem:
    """openvino_genai.ContinuousBatchingPipeline on the GGUF (converted by GenAI's own GGUF reader).

    Eviction (SchedulerConfig.use_cache_eviction) runs only once the prompt is fully prefilled
    ("do not evict during prefill" in GenAI), in whole blocks, keeping start_size + recent_size + the
    best-scored blocks in between, up to max_cache_size. Scores: SnapKV-style over the last
    snapkv_window_size prompt tokens, then accumulated over generated tokens (NORM_SUM).
    The eviction config is fixed per pipeline, so one pipeline is compiled per distinct config and
    kept for reuse (a few seconds each)."""

    # Why there is no KL for it (openvino_genai 2026.4's GenerationConfig / GenerationOutput):
    KL_NOTE = ("not measurable: OpenVINO GenAI returns only the log-probability of each token it generates itself "
               "(GenerationConfig.logprobs: 'only single top logprob can be returned'; GenerationOutput."
               "generated_log_probs), never a full next-token distribution, and it cannot teacher-force a given "
               "answer after eviction (a reference put in the prompt would be prefilled, and scored, before its "
               "eviction runs)")

    def __init__(self, gguf: str, threads: int, evict: bool, snapkv_window: int, start_size: int,
                 recent_size: int):
        import openvino as ov
        import openvino_genai as og
        self.og = og
        self.gguf, self.threads, self.evict = gguf, threads, evict
        self.snapkv_window, self.start_pref, self.recent_pref = snapkv_window, start_size, recent_size
        self.fatal = None
        self.block = 32  # GenAI's CPU KV block size; corrected from its error text if it differs
        self.pipes: dict = {}
        try:
            prec = ov.Core().get_property("CPU", "KV_CACHE_PRECISION")  # the CPU plugin's default, used here
            self.kv_precision = prec.get_type_name() if hasattr(prec, "get_type_name") else str(prec)
        except Exception:  # noqa: BLE001
            self.kv_precision = None
        t0 = time.perf_counter()
        self.tok = og.Tokenizer(gguf)  # GenAI's GGUF reader builds the tokenizer + chat template
        self.load_seconds = time.perf_counter() - t0

    def _pipe(self, ev: tuple | None, nblocks: int):
        key = (ev, nblocks)
        if key in self.pipes:
            return self.pipes[key]
        og = self.og
        sc = og.SchedulerConfig()
        sc.num_kv_blocks = nblocks  # fixed pool, so cache_usage (%) converts exactly to blocks
        if ev is not None:
            start, recent, mx = ev
            sc.use_cache_eviction = True
            sc.cache_eviction_config = og.CacheEvictionConfig(start, recent, mx, og.AggregationMode.NORM_SUM,
                                                              snapkv_window_size=self.snapkv_window)
        t0 = time.perf_counter()
        try:
            pipe = og.ContinuousBatchingPipeline(self.gguf, sc, "CPU", {"INFERENCE_NUM_THREADS": self.threads})
        except Exception as exc:
            if "multiple of block size" not in str(exc):
                self.fatal = "load failed: " + first_line(exc)  # the model itself: no use retrying per case
            raise
        self.load_seconds += time.perf_counter() - t0
        if len(self.pipes) >= 2:  # bound memory: drop the oldest
            self.pipes.pop(next(iter(self.pipes)))
        self.pipes[key] = pipe
        return pipe

    def n_tokens(self, text: str) -> int:
        return int(self.tok.encode(text, add_special_tokens=False).input_ids.shape[1])

    def eviction_sizes(self, budget: float, ctx_tokens: int, prompt_tokens: int, max_new: int) -> tuple:
        """(start_size, recent_size, max_cache_size): GenAI wants whole blocks and max > start + recent."""
        b = self.block
        if budget >= 1.0:  # nothing may be evicted: room for the whole prompt and the answer
            mx = b * (math.ceil((prompt_tokens + max_new) / b) + 1)
        else:
            mx = b * max(3, round(budget * ctx_tokens / b + 1e-9))
        start = b * max(1, self.start_pref // b)
        if start > mx - 2 * b:
            start = b
        # recent area at most half of what start leaves, so that the scored (evictable) middle is never smaller
        recent = b * max(1, min(self.recent_pref // b, (mx - start) // 2 // b))
        assert mx > start + recent and not (mx % b or start % b or recent % b), (start, recent, mx)
        return start, recent, mx

    def run(self, case: dict) -> dict:
        budget, placement = float(case["budget"]), case["placement"]
        if self.fatal:
            return {"skipped": self.fatal}
        if self.evict and placement == "after":
            return {"skipped": "placement 'after' not possible: OpenVINO GenAI evicts only after the whole prompt "
                               "(question included) is prefilled; it cannot compress the context before the question"}
        text = case["context"] + QA_SEP + case["question"]
        prompt = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = self.tok.encode(prompt, add_special_tokens=False).input_ids
        n_prompt = int(ids.shape[1])
        ctx_tokens = self.n_tokens(case["context"])
        max_new = int(case["max_new_tokens"])
        b = self.block
        need_blocks = math.ceil((n_prompt + max_new) / b) + 4
        nblocks = max(256, 1 << (need_blocks - 1).bit_length())
        extra = {"block_size": b, "num_kv_blocks": nblocks, "kv_cache_precision": self.kv_precision,
                 "context_tokens": ctx_tokens}
        ev = None
        if self.evict:
            ev = self.eviction_sizes(budget, ctx_tokens, n_prompt, max_new)
            extra["ov_target_tokens"] = round(budget * ctx_tokens, 1)  # max_cache_size is this in whole blocks, >= 3
            extra["ov_eviction"] = {"start_size": ev[0], "recent_size": ev[1], "max_cache_size": ev[2],
                                    "aggregation_mode": "NORM_SUM", "snapkv_window_size": self.snapkv_window,
                                    "apply_rotation": False}
        try:
            pipe = self._pipe(ev, nblocks)
            return self._generate(pipe, ids, n_prompt, max_new, extra)
        except RuntimeError as exc:
            import re
            m = re.search(r"multiple of block size (\d+)", str(exc))
            if not m or int(m.group(1)) == self.block:
                raise
            self.block = int(m.group(1))  # rerun with sizes in this device's blocks
            return self.run(case)

    def _generate(self, pipe, ids, n_prompt: int, max_new: int, extra: dict) -> dict:
        b, nblocks = self.block, extra["num_kv_blocks"]
        gc = pipe.get_config()
        gc.max_new_tokens = max_new
        gc.do_sample = False
        gc.num_beams = 1
        t0 = time.perf_counter()
        handle = pipe.add_request(0, ids, gc)
        usage = []  # blocks in use, as scheduled at each step
        while pipe.has_non_finished_requests():
            pipe.step()
            usage.append(round(pipe.get_metrics().cache_usage * nblocks / 100.0))
        outs = handle.read_all()
        secs = time.perf_counter() - t0
        gen_ids = list(outs[0].generated_ids) if outs else []
        answer = self.tok.decode(gen_ids, skip_special_tokens=True) if gen_ids else ""
        peak = max(usage) if usage else 0
        drop = next((i for i in range(1, len(usage)) if usage[i] < usage[i - 1]), None)
        if drop is not None:
            kept = usage[drop]
            kept_note = ("cache occupancy right after the first eviction (blocks in use x block size, so rounded up "
                         "to whole blocks; includes the chat template, the question and the 1-2 tokens generated "
                         "so far)")
        else:
            kept = peak
            kept_note = ("no eviction happened: cache occupancy at its peak (blocks in use x block size; prompt and "
                         "generated tokens)")
        extra.update({"evicted": drop is not None, "final_cache_tokens": (usage[-1] * b) if usage else None,
                      "generated_tokens": len(gen_ids)})
        note = ("OpenVINO GenAI ContinuousBatchingPipeline; the whole prompt is prefilled (peak = full prompt), then "
                "eviction runs, so its scores always see the question. max_cache_size counts every cached token "
                "(template + context + question + generated), sized from budget x context tokens, whole blocks")
        if not self.evict:
            note = "OpenVINO GenAI ContinuousBatchingPipeline, no eviction (full cache); placement changes nothing"
        return {"answer": answer, "prompt_tokens": n_prompt, "kept_tokens": kept * b, "kept_note": kept_note,
                "peak_cache_tokens": peak * b, "seconds": secs, "note": note, **extra}


# ---------------------------------------------------------------------------------------------- kvpress

_HF_CACHE: dict = {}


def load_hf(gguf: str, threads: int):
    """transformers dequantizes the GGUF to float32 (CPU); shared by every kvpress system."""
    if gguf in _HF_CACHE:
        return _HF_CACHE[gguf]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF dequantization bar
    import torch
    torch.set_num_threads(threads)
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    d, f = os.path.split(os.path.abspath(gguf))
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
    model.eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    _HF_CACHE[gguf] = (pipe, time.perf_counter() - t0)
    return _HF_CACHE[gguf]


_REFS: dict = {}  # the full-cache reference per (model, prompt): shared by every press system


def _case_key(gguf: str, case: dict) -> str:
    import hashlib
    parts = [gguf, case["placement"], case["context"], case["question"], str(int(case["max_new_tokens"])),
             json.dumps(case.get("context_ids")), json.dumps(case.get("question_ids"))]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


class KVPressSystem:
    """kvpress's own pipeline: prefill of the "context" (chat-template head + context [+ question]) under
    the press, which prunes each layer's KV right after that layer runs; then the question (kvpress
    appends the template tail to it) and greedy decoding on the compressed cache."""

    def __init__(self, gguf: str, threads: int, press: str | None):
        self.pipe, self.load_seconds = load_hf(gguf, threads)
        self.gguf = gguf
        self.press_name = press
        self.threads = threads

    def make_press(self, budget: float):
        import kvpress
        if self.press_name is None:
            return None, {}
        ratio = max(0.0, min(1.0, 1.0 - budget))
        cls = {"snapkv": kvpress.SnapKVPress, "streaming": kvpress.StreamingLLMPress,
               "expected": kvpress.ExpectedAttentionPress}[self.press_name]
        press = cls(compression_ratio=ratio)
        params = {k: getattr(press, k) for k in press.__dataclass_fields__ if not k.startswith("_")}
        params = {k: v for k, v in params.items() if isinstance(v, (int, float, bool, str, type(None)))}
        return press, {"press": cls.__name__, "press_params": params}

    @staticmethod
    def parts(case: dict) -> tuple[str, str]:
        """kvpress's "context" and "question" texts for the case's placement."""
        if case["placement"] == "inside":
            return case["context"] + QA_SEP + case["question"], ""
        return case["context"], QA_SEP + case["question"]

    def inputs(self, case: dict) -> dict:
        """What kvpress's pipe.preprocess gives: {"context_ids": [1, n], "questions_ids": [[1, m]]}, or the
        caller's token ids (context_ids / question_ids) in the same form."""
        import torch
        if ("context_ids" in case) != ("question_ids" in case):
            raise ValueError("context_ids and question_ids go together")
        if "context_ids" in case:
            return {"context_ids": torch.tensor([case["context_ids"]], dtype=torch.long),
                    "questions_ids": [torch.tensor([case["question_ids"]], dtype=torch.long)]}
        context, question = self.parts(case)
        return self.pipe.preprocess(context, questions=[question], answer_prefix="", max_context_length=int(1e10))

    def stop_ids(self) -> set[int]:
        """End of the reference: the model's EOS ids (what kvpress stops at) and the chat templates'
        end-of-turn tokens (as benchmarks/_harness.stop_tokens)."""
        tok, model = self.pipe.tokenizer, self.pipe.model
        stop = set()
        for ids in (model.generation_config.eos_token_id, model.config.eos_token_id, tok.eos_token_id):
            stop |= {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]) if i is not None}
        for text in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == 1 and ids[0] != tok.unk_token_id:
                stop.add(int(ids[0]))
        return stop

    def forced_logits(self, cache, n_ctx: int, q_ids, ref: list[int]):
        """Logits (float32, [len(ref), vocab]) of the steps of ``ref``: the question part and ref[:-1]
        in one causal forward on ``cache`` (the prefilled context), at kvpress's positions (from the
        uncompressed context length on, as generate_answer)."""
        import torch
        if q_ids.shape[1] == 0:
            raise ValueError("kvpress's question part is empty: no first distribution to compare")
        seq = torch.cat([q_ids, torch.tensor([ref[:-1]], dtype=q_ids.dtype)], dim=1)
        pos = torch.arange(n_ctx, n_ctx + seq.shape[1]).unsqueeze(0)
        out = self.pipe.model(input_ids=seq, past_key_values=cache, position_ids=pos, logits_to_keep=len(ref))
        return out.logits[0, -len(ref):].float().clone()

    def reference(self, case: dict, pre: dict) -> dict:
        """Greedy decoding without press (kvpress's uncompressed cache), then its own logits along it,
        teacher-forced as the presses' are. Once per prompt."""
        import torch
        from transformers import DynamicCache
        key = _case_key(self.gguf, case)
        if key in _REFS:
            return _REFS[key]
        model, max_new, stop = self.pipe.model, int(case["max_new_tokens"]), self.stop_ids()
        ctx_ids, q_ids = pre["context_ids"], pre["questions_ids"][0]
        n_ctx = int(ctx_ids.shape[1])
        t0 = time.perf_counter()
        with torch.inference_mode():
            cache = DynamicCache()
            model.model(input_ids=ctx_ids, past_key_values=cache)      # kvpress's prefill, no press
            lengths = [cache.get_seq_length(i) for i in range(len(cache))]
            pos = torch.arange(n_ctx, n_ctx + q_ids.shape[1]).unsqueeze(0)
            lg = model(input_ids=q_ids, past_key_values=cache, position_ids=pos, logits_to_keep=1).logits[0, -1]
            ref, first = [], int(lg.argmax())
            nxt, p = first, n_ctx + q_ids.shape[1]
            for i in range(max_new):
                if nxt in stop:
                    break
                ref.append(nxt)
                if i + 1 < max_new:
                    lg = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache,
                               position_ids=torch.tensor([[p]])).logits[0, -1]
                    nxt, p = int(lg.argmax()), p + 1
            for layer, n in zip(cache.layers, lengths):                 # back to the prefilled context
                layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
            empty = not ref
            if empty:            # the full cache stops at once: compare its first distribution only
                ref = [first]
            logits = self.forced_logits(cache, n_ctx, q_ids, ref)
        text = self.pipe.tokenizer.decode(ref if not empty else [], skip_special_tokens=True)
        _REFS[key] = {"tokens": ref, "logits": logits, "answer": text, "empty": empty,
                      "seconds": time.perf_counter() - t0}
        return _REFS[key]

    def kl(self, ref: dict, cache, n_ctx: int, q_ids) -> dict:
        import torch
        t0 = time.perf_counter()
        with torch.inference_mode():
            own = self.forced_logits(cache, n_ctx, q_ids, ref["tokens"])
            lp_full = torch.log_softmax(ref["logits"].double(), dim=-1)
            lp = torch.log_softmax(own.double(), dim=-1)
            kl = (lp_full.exp() * (lp_full - lp)).sum(-1).clamp_min(0.0)   # clamp: float64 round-off only
            agree = (lp.argmax(-1) == torch.tensor(ref["tokens"])).double()
        per = [float(x) for x in kl]
        return {"kl_mean": float(sum(per) / len(per)), "agreement": float(agree.mean()),
                "reference_answer": ref["answer"], "kl_steps": len(per), "kl_per_step": per,
                "reference_empty": ref["empty"], "reference_seconds": round(ref["seconds"], 3),
                "kl_seconds": round(time.perf_counter() - t0, 3),
                "kl_note": ("KL(full || press) in nats along kvpress's uncompressed greedy answer, teacher-forced "
                            "on the compressed cache; mean over the answer's steps" +
                            (" (the full cache stops at once: its first distribution only)" if ref["empty"] else ""))}

    def run(self, case: dict) -> dict:
        import torch
        from transformers import DynamicCache
        budget, placement = float(case["budget"]), case["placement"]
        context, question = self.parts(case)
        pipe = self.pipe
        pre = self.inputs(case)
        n_ctx = int(pre["context_ids"].shape[1])
        n_q = int(pre["questions_ids"][0].shape[1])
        press, extra = self.make_press(budget)
        extra["kvpress_context_tokens"] = n_ctx
        if "context_ids" in case:
            extra["token_ids"] = "given by the caller (context_ids / question_ids), not kvpress's tokenization"
        else:
            extra["context_tokens"] = len(pipe.tokenizer.encode(case["context"], add_special_tokens=False))
        ref = self.reference(case, pre) if case.get("kl") else None
        cache = DynamicCache()
        seen = []
        orig = pipe._remove_answer_from_cache

        def spy(c, lengths):  # cache length with question + answer, just before kvpress trims it off
            seen.append(c.get_seq_length())
            return orig(c, lengths)

        pipe._remove_answer_from_cache = spy
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                if "context_ids" in case:   # kvpress's pipeline minus its preprocess (tokenization)
                    out = pipe.postprocess(pipe.forward(pre, press=press, max_new_tokens=int(case["max_new_tokens"]),
                                                        cache=cache), single_question=True)
                else:
                    out = pipe(context, question=question, press=press, max_new_tokens=int(case["max_new_tokens"]),
                               cache=cache)
            secs = time.perf_counter() - t0
        finally:
            del pipe._remove_answer_from_cache
        kept = int(cache.get_seq_length())  # the compressed context; kvpress removed question + answer
        peak = max([n_ctx] + seen)
        if ref is not None:  # the cache holds the compressed context, as kvpress left it after answering
            extra.update(self.kl(ref, cache, n_ctx, pre["questions_ids"][0]))
        if placement == "inside":
            kept_note = ("KV length after prefill compression (cache.get_seq_length()); the compressed text is "
                         "template head + context + question; only the template tail and the answer come after")
        else:
            kept_note = ("KV length of the compressed context (template head + context) after prefill; the "
                         "question and the answer are then appended uncompressed")
        note = ("kvpress pipeline; compression_ratio = 1 - budget over kvpress's 'context' (which includes the "
                "chat-template head and, for 'inside', the question); pruning is per layer during prefill, so "
                "one layer at a time holds the full prompt (peak_cache_tokens = longest per-layer KV length)")
        if press is None:
            note = "kvpress pipeline, no press (full cache)"
            kept_note = "no press: KV length of kvpress's whole context part (template head + context" + (
                " + question)" if placement == "inside" else "); question and answer come after it")
        return {"answer": out["answer"], "prompt_tokens": n_ctx + n_q, "kept_tokens": kept, "kept_note": kept_note,
                "peak_cache_tokens": int(peak), "seconds": secs, "note": note, **extra}


# ---------------------------------------------------------------------------------------------- driver

def make_system(name: str, args):
    if name == "openvino":
        return OpenVINOSystem(args.gguf, args.threads, True, args.ov_snapkv_window, args.ov_start, args.ov_recent)
    if name == "openvino-full":
        return OpenVINOSystem(args.gguf, args.threads, False, args.ov_snapkv_window, args.ov_start, args.ov_recent)
    if name.startswith("kvpress-"):
        press = name.split("-", 1)[1]
        if press not in ("snapkv", "streaming", "expected", "full"):
            raise ValueError(f"unknown kvpress system {name}")
        return KVPressSystem(args.gguf, args.threads, None if press == "full" else press)
    raise ValueError(f"unknown system {name}; known: {','.join(ALL_SYSTEMS)}")


def run_all(cases: list[dict], systems: list[str], args, out_path: str | None) -> list[dict]:
    vers = versions()
    rows = []
    fh = open(out_path, "w") if out_path else None
    try:
        for name in systems:
            sysobj, load_err = None, None
            try:
                sysobj = make_system(name, args)
            except Exception as exc:  # noqa: BLE001
                load_err = "load failed: " + first_line(exc)
                if args.verbose:
                    traceback.print_exc()
            for case in cases:
                row = {"id": case["id"], "system": name, "placement": case["placement"],
                       "budget": float(case["budget"]), "answer": "", "prompt_tokens": None, "kept_tokens": None,
                       "kept_note": None, "peak_cache_tokens": None, "seconds": None, "threads": args.threads,
                       "skipped": load_err, "versions": vers, "gguf": os.path.basename(args.gguf)}
                if sysobj is not None:
                    try:
                        if case["placement"] not in ("inside", "after"):
                            raise ValueError(f"placement must be 'inside' or 'after', not {case['placement']!r}")
                        row.update(sysobj.run(case))
                        row["load_seconds"] = round(sysobj.load_seconds, 3)
                    except Exception as exc:  # noqa: BLE001
                        row["skipped"] = first_line(exc)
                        if args.verbose:
                            traceback.print_exc()
                    if isinstance(row.get("seconds"), float):
                        row["seconds"] = round(row["seconds"], 3)
                if case.get("kl") and "kl_mean" not in row:   # not measured: say why, never a number
                    row.update(kl_mean=None, agreement=None, reference_answer=None, kl_steps=None,
                               kl_note=getattr(sysobj, "KL_NOTE", None) or f"not measured: {row['skipped']}")
                rows.append(row)
                if fh:
                    fh.write(json.dumps(row) + "\n")
                    fh.flush()
                print(f"[peers] {name:18s} {case['id']:>14s} {case['placement']:6s} b={row['budget']:<4} "
                      + (f"skipped: {row['skipped']}" if row["skipped"] else
                         f"kept={row['kept_tokens']} peak={row['peak_cache_tokens']} {row['seconds']}s "
                         + (f"kl={row['kl_mean']:.4g} agree={row['agreement']:.2f} "
                            if row.get("kl_mean") is not None else "")
                         + f"{row['answer'][:40]!r}"), file=sys.stderr, flush=True)
            del sysobj
    finally:
        if fh:
            fh.close()
    return rows


FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]


def check_cases(reps_per_half: int = 20) -> list[dict]:
    """The classic passkey filler; about 1k prompt tokens with SmolLM2's tokenizer, the needle at 50% depth."""
    half = " ".join(FILLER * reps_per_half)
    context = half + " The secret code is BLUEBIRD. " + half
    cases = []
    for budget in (1.0, 0.2):
        for placement in ("inside", "after"):
            cases.append({"id": f"needle-b{budget:g}-{placement}", "context": context,
                          "question": "What is the secret code?", "budget": budget, "placement": placement,
                          "max_new_tokens": 16})
    return cases


def print_table(rows: list[dict]) -> None:
    hdr = f"{'system':18s} {'place':6s} {'budget':>6s} {'prompt':>6s} {'kept':>6s} {'peak':>6s} {'sec':>7s} ok  answer"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if r["skipped"]:
            print(f"{r['system']:18s} {r['placement']:6s} {r['budget']:6.2f}  skipped: {r['skipped'][:90]}")
            continue
        ok = "Y" if "BLUEBIRD" in (r["answer"] or "").upper() else "-"
        print(f"{r['system']:18s} {r['placement']:6s} {r['budget']:6.2f} {r['prompt_tokens']:6d} "
              f"{str(r['kept_tokens']):>6s} {str(r['peak_cache_tokens']):>6s} {r['seconds']:7.2f} {ok}   "
              f"{(r['answer'] or '').strip()[:48]!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF) if DEFAULT_GGUF.exists() else None)
    ap.add_argument("--in", dest="inp", help="input cases, jsonl")
    ap.add_argument("--out", help="output rows, jsonl (overwritten)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    ap.add_argument("--check", action="store_true", help="built-in ~1k-token needle smoke test; prints a table")
    ap.add_argument("--ov-snapkv-window", type=int, default=8, help="OpenVINO snapkv_window_size (its default: 8)")
    ap.add_argument("--ov-start", type=int, default=32, help="OpenVINO start_size wish (rounded to blocks)")
    ap.add_argument("--ov-recent", type=int, default=128, help="OpenVINO recent_size wish (shrunk for small caches)")
    ap.add_argument("--kl", action="store_true", help="every case as if it had \"kl\": true (kvpress: KL against "
                    "the full cache along its answer)")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failures on stderr")
    args = ap.parse_args()
    if not args.gguf or not os.path.exists(args.gguf):
        ap.error(f"--gguf: no such file: {args.gguf}")
    args.gguf = os.path.abspath(args.gguf)
    # Pin threads before torch / OpenVINO start their pools.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.check:
        cases = check_cases()
    else:
        if not args.inp or not args.out:
            ap.error("--in and --out are required (or use --check)")
        with open(args.inp) as fh:
            cases = [json.loads(ln) for ln in fh if ln.strip()]
        for c in cases:
            missing = {"id", "context", "question", "budget", "placement", "max_new_tokens"} - set(c)
            if missing:
                ap.error(f"case {c.get('id')!r} lacks {sorted(missing)}")
    if args.kl:
        for c in cases:
            c["kl"] = True
    rows = run_all(cases, systems, args, args.out)
    if args.check:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
