"""The ``entrokv-edge`` command.

    entrokv-edge run -m smollm2-135m -f docs/sample.txt -p "Who found the ledger?" --kv-cells 1024
    entrokv-edge chat -m model.gguf --kv-cells 2048
    entrokv-edge inspect -m smollm2-135m -f essay.txt --png heads.png
    entrokv-edge run ... --set page_size=16 --set lookahead=0      # any setting (docs/options.md)
    entrokv-edge serve -m smollm2-135m --kv-cells 2048 --port 8000  # OpenAI-compatible HTTP (docs/server.md)
    entrokv-edge rpc-server --host 127.0.0.1 --port 50052           # (a -DGGML_RPC=ON build; docs/gpu.md)

Bad input gets one line on stderr and exit status 2; nothing prints a traceback.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import sys
import time
import typing
from pathlib import Path

from .controller import EvictionConfig
from .controller.config import DEFAULT_BUDGET

EXIT_USAGE = 2
DESCRIPTION = ("Answer a prompt, chat, serve or inspect a model's heads with a KV cache of bounded size: "
               "Page-EntroKV eviction inside llama.cpp.")
MAX_TEXT_BYTES = 16 << 20       # a -f file larger than this is refused (a model's whole context is far less)


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line on stderr and exit status 2, like every other
    refusal of the command (argparse's own prints the usage first)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"entrokv-edge: {message} (see {self.prog} --help)\n")


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def _budget(text: str):
    try:
        v = _finite(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"budget must be a fraction (0.2) or a token count (512), got {text!r}")
    return v if ("." in text or "e" in text.lower()) else int(v)


# the policies a user picks between on the command line; every other one (the baselines the method is compared
# with) stays reachable through --set policy=NAME
MAIN_POLICIES = ("entrokv-edge", "page-entrokv", "streaming", "full")


def _at_least(lo: int):
    """An argparse type: an integer >= lo."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        return v
    return parse


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="entrokv-edge", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = _Parser(add_help=False)
    common.add_argument("-m", "--model", required=True, help="a .gguf file, or a registered name (entrokv-models list)")
    common.add_argument("--kv-cells", type=_at_least(1), metavar="N", help="the KV cache, in tokens, at most the "
                        "model's context (default: the prompt and the answer fit)")
    common.add_argument("--budget", type=_budget, metavar="B", help="tokens each KV head keeps after the prompt: a fraction of "
                        "it (0.2) or a count (512); default: what --kv-cells can keep, or "
                        f"{DEFAULT_BUDGET} of the prompt when the cache is sized to it")
    common.add_argument("--policy", choices=MAIN_POLICIES, help="what is kept: entrokv-edge (default), page-entrokv "
                        "(the method as published), streaming (sinks and recent tokens), full (no eviction)")
    common.add_argument("--recall", action=argparse.BooleanOptionalAction, default=None,
                        help="keep evicted tokens in host memory and bring them back when the answer being generated "
                        "(or a later question) needs them (docs/options.md, 'Recall')")
    common.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other setting (docs/options.md), e.g. --set page_size=16; repeatable")
    common.add_argument("--config", metavar="FILE", help="settings from a JSON object (--set and flags win)")
    common.add_argument("--threads", type=_at_least(1), metavar="N", help="CPU threads (default: llama.cpp's; at most 512)")
    common.add_argument("--n-gpu-layers", type=int, default=0, metavar="N", help="layers (and their cache) on a GPU; -1: all")
    common.add_argument("--rpc", action="append", metavar="HOST:PORT", help=argparse.SUPPRESS)   # docs/gpu.md
    common.add_argument("--verbose", action="store_true", help="show llama.cpp's logs")
    for name, help_ in (("run", "answer one prompt"), ("chat", "interactive chat"), ("inspect", "per-head statistics")):
        p = sub.add_parser(name, parents=[common], help=help_, description=help_)
        if name != "chat":
            p.add_argument("-f", "--file", help="a text file to put before the prompt")
            p.add_argument("-p", "--prompt", default="", help="the prompt (after the file)")
            p.add_argument("--json", action="store_true", help="one JSON object on stdout")
        if name != "inspect":
            p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                           help="the answer's length at most (default 256; <= 0: until the model stops)")
            p.add_argument("--temp", type=_finite, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)")
            p.add_argument("--raw", action="store_true", help="plain completion, no chat template")
        if name == "inspect":
            p.add_argument("--png", help="also write the figures to this PNG (needs matplotlib)")
    p = sub.add_parser("rpc-server", help="serve this machine's CPU to llama.cpp RPC clients")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback; the protocol "
                   "has no authentication: expose it only on a trusted network)")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--threads", type=_at_least(1), help="CPU threads (default: all; at most 512)")
    p.add_argument("--cache-dir", help="keep received tensors here, so a model is sent once")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's logs")
    from . import server                # serve: its flags and its logic live in server.py
    server.add_parser(sub, common)
    return ap


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:      # at most MAX_TEXT_BYTES + 1 bytes: a device or a huge file ends here
            data = f.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}")
    if len(data) > MAX_TEXT_BYTES:
        raise CLIError(f"{path} is larger than {MAX_TEXT_BYTES >> 20} MiB: far more text than a model's context")
    if b"\0" in data:
        raise CLIError(f"{path} is not a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CLIError(f"{path} is not a UTF-8 text file")


def _prompt_text(args) -> str:
    parts = []
    if getattr(args, "file", None):
        parts.append(_read_text(args.file))
    if args.prompt:
        parts.append(args.prompt)
    text = "\n\n".join(p for p in parts if p.strip())
    if not text.strip():
        raise CLIError("the prompt is empty (give -p TEXT and/or -f FILE)")
    return text


def _model_file(name: str) -> Path:
    from .models import ModelError, model_path
    try:
        path = model_path(name)
    except ModelError as e:
        raise CLIError(str(e))
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}")
    if magic != b"GGUF":
        raise CLIError(f"{path} is not a GGUF model file")
    return path


_LOG_CB = None


def _quiet_llama() -> None:
    """Silence llama.cpp's own logging (the default without --verbose)."""
    global _LOG_CB
    import llama_cpp
    _LOG_CB = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


def _parse_value(key: str, text: str):
    """A --set value as the setting's type (int, float, text; "none" where None is allowed)."""
    hints = typing.get_type_hints(EvictionConfig)
    kinds = set(typing.get_args(hints[key])) or {hints[key]}
    if text.lower() in ("none", "null") and type(None) in kinds:
        return None
    if bool in kinds:
        if text.lower() not in ("true", "false"):
            raise CLIError(f"--set {key}: expected true or false, got {text!r}")
        return text.lower() == "true"
    if key == "budget":
        try:
            return _budget(text)
        except argparse.ArgumentTypeError as e:
            raise CLIError(f"--set budget: {e}")
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                raise CLIError(f"--set {key}: expected {'an integer' if kind is int else 'a number'}, got {text!r}")
    return text


def _settings(args) -> dict:
    """The EvictionConfig of args: --config's file, then --set, then --budget and --policy."""
    fields = {f.name for f in dataclasses.fields(EvictionConfig)}
    given: dict = {}
    if getattr(args, "config", None):
        try:
            data = json.loads(_read_text(args.config))
        except json.JSONDecodeError as e:
            raise CLIError(f"{args.config} is not a JSON object of settings ({e.msg}, line {e.lineno})")
        except (ValueError, RecursionError) as e:     # a number of thousands of digits, nesting too deep
            raise CLIError(f"{args.config} is not a JSON object of settings ({type(e).__name__}: {str(e)[:80]})")
        if not isinstance(data, dict):
            raise CLIError(f"{args.config} must hold a JSON object of settings, e.g. {{\"page_size\": 16}}")
        given.update(data)
    for item in getattr(args, "set", None) or []:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in fields:
            raise CLIError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        given[key] = _parse_value(key, value.strip())
    unknown = sorted(set(given) - fields)
    if unknown:
        raise CLIError(f"unknown setting(s) {', '.join(unknown)}; settings: {', '.join(sorted(fields))}")
    if args.budget is not None:
        given["budget"] = args.budget
    if args.policy is not None:
        given["policy"] = args.policy
    try:
        cfg = EvictionConfig(**given)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e).replace("EvictionConfig: ", ""))
    return {"eviction": cfg}


def _load(args, n_prompt: int | None):
    """An EntroKVLlama for args; n_prompt (tokens) sizes the default cache and checks the budget."""
    from . import EntroKVError, EntroKVLlama
    from .runtime.llama import cells_to_hold, reserved_cells
    path = _model_file(args.model)
    settings = _settings(args)
    cfg = settings["eviction"]
    max_new = max(getattr(args, "max_tokens", 0) or 0, 0)
    n_ctx = _context_length(args)
    cells = args.kv_cells
    if cells is None:
        # the prompt and the answer fit beside the cells an eviction leaves free
        cells = min(cells_to_hold((n_prompt or 2048) + max_new + 64, cfg), max(n_ctx, 256))
        if cfg.budget is None:      # a cache sized to the prompt: the budget is a share of it
            cfg = settings["eviction"] = dataclasses.replace(cfg, budget=DEFAULT_BUDGET)
    elif cells > n_ctx:
        raise CLIError(f"--kv-cells {cells} is more than the model's context ({n_ctx} tokens): "
                       f"cells beyond it could never hold a token")
    if n_prompt is not None and n_prompt >= n_ctx:
        raise CLIError(f"the prompt ({n_prompt} tokens) does not fit the model's context ({n_ctx} tokens)")
    if n_prompt is not None and cfg.budget is not None:
        try:
            cfg.budget_pages(n_prompt)
        except ValueError as e:
            raise CLIError(str(e))
        tokens = cfg.budget_tokens(n_prompt)
        reserve = reserved_cells(cells, cfg)
        if cfg.policy != "full" and tokens > cells - reserve:
            raise CLIError(f"budget of {tokens} tokens is above what a {cells}-cell cache can keep "
                           f"({cells - reserve}, leaving room for new tokens); lower --budget or raise --kv-cells")
    batch = _batch_size(args, cells, cfg)
    kwargs = dict(n_ctx=cells, n_batch=batch, n_ubatch=batch, verbose=args.verbose, n_gpu_layers=args.n_gpu_layers)
    if args.rpc:
        from .runtime.rpc import RPCUnavailableError, add_servers
        try:
            add_servers(args.rpc)
        except (RPCUnavailableError, ValueError) as e:
            raise CLIError(str(e))
    if args.threads:
        kwargs.update(n_threads=args.threads, n_threads_batch=args.threads)
    if args.recall is not None:
        kwargs["recall"] = args.recall
    try:
        return EntroKVLlama(str(path), **settings, **kwargs)
    except EntroKVError as e:
        raise CLIError(f"{path.name}: this model is not supported ({e.message})")
    except ValueError as e:
        msg = str(e)
        if "Failed to load model" in msg:
            raise CLIError(f"{path}: llama.cpp could not load this model (corrupt or unsupported architecture)")
        raise CLIError(msg)


def _vocab(args):
    """The model's vocabulary and header (a vocab-only llama_cpp.Llama), loaded once per command."""
    if getattr(args, "_vocab", None) is None:
        import llama_cpp
        path = _model_file(args.model)
        try:
            args._vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=args.verbose)
        except ValueError:
            raise CLIError(f"{path}: llama.cpp could not load this model (corrupt or unsupported architecture)")
    return args._vocab


def _batch_size(args, cells: int, cfg) -> int:
    """n_batch and n_ubatch for a cache of ``cells``: 512, or less on a model with sliding-window
    layers (GGUF key <arch>.attention.sliding_window), whose cache keeps the last n_swa tokens plus
    a ubatch in as many cells as the base cache: the largest multiple of 32 that fits beside n_swa.
    A ubatch must hold the observed window: a cache too small for that is refused here."""
    meta = _vocab(args).metadata
    try:
        n_swa = int(meta.get(f"{meta.get('general.architecture', '')}.attention.sliding_window", 0) or 0)
    except ValueError:
        n_swa = 0
    room = (cells - n_swa) // 32 * 32
    if not n_swa or room >= 512:
        return 512
    if room < cfg.window:
        need = n_swa + -(-cfg.window // 32) * 32
        raise CLIError(f"--kv-cells {cells} cannot run this model's sliding-window layers: they keep the last {n_swa} "
                       f"tokens plus a batch of at least the observed window ({cfg.window}); use --kv-cells {need} "
                       f"or more")
    return room


def _context_length(args) -> int:
    """The model's training context (GGUF key <arch>.context_length; a vocab-only model has no
    hyperparameters): the longest conversation EntroKVLlama accepts."""
    meta = _vocab(args).metadata
    try:
        return int(meta[f"{meta['general.architecture']}.context_length"])
    except (KeyError, ValueError):
        raise CLIError(f"{args.model}: the model file does not give its context length")


def _count_tokens(args, text: str) -> int:
    n = len(_vocab(args).tokenize(text.encode()))
    return n + (0 if getattr(args, "raw", True) else 32)   # the chat template's own tokens


def _progress_bar(enabled: bool):
    if not enabled:
        return None, None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, None
    bar = tqdm(total=0, unit="tok", desc="prefill", file=sys.stderr, leave=False)

    def update(done, total):
        if bar.total != total:
            bar.reset(total=total)
        bar.n = done
        bar.refresh()
    return bar, update


def _generate(llm, args, text: str, on_text):
    """Stream the answer to on_text; returns (answer, prefill seconds, decode seconds, decode tokens)."""
    t0 = time.perf_counter()
    t_first, n_out, pieces = None, 0, []
    if args.raw:
        stream = llm.create_completion(text, max_tokens=args.max_tokens, temperature=args.temp, stream=True)
        get = lambda c: c["choices"][0].get("text", "")  # noqa: E731
    else:
        stream = llm.create_chat_completion([{"role": "user", "content": text}], max_tokens=args.max_tokens,
                                            temperature=args.temp, stream=True)
        get = lambda c: c["choices"][0]["delta"].get("content", "") or ""  # noqa: E731
    for chunk in stream:
        piece = get(chunk)
        if t_first is None:
            t_first = time.perf_counter()
        if piece:
            n_out += 1
            pieces.append(piece)
            on_text(piece)
    t_end = time.perf_counter()
    t_first = t_first or t_end
    return "".join(pieces), t_first - t0, t_end - t_first, n_out


def cmd_run(args) -> int:
    text = _prompt_text(args)
    n_prompt = _count_tokens(args, text)
    bar, update = _progress_bar(sys.stderr.isatty() and not args.json and n_prompt > 1024)
    llm = _load(args, n_prompt)
    llm.progress = update
    echo = (lambda s: None) if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    n0 = llm.n_tokens
    try:
        answer, t_pre, t_dec, n_dec = _generate(llm, args, text, echo)
    except ValueError as e:             # llama-cpp-python's refusal of a prompt longer than the context
        raise CLIError(f"not answered: {e}")
    if bar is not None:
        bar.close()
    rep = llm.kv_report()
    n_prefill = max(rep["logical_tokens"] - n0 - n_dec, 1)
    m = llm.last_eviction.metrics if llm.last_eviction is not None else {}
    out = {"answer": answer, "policy": llm.config.policy, "logical_tokens": rep["logical_tokens"],
           "kept_tokens": rep["kept_tokens"], "kv_cells": rep["kv_cells"], "kv_bytes_full": rep["kv_bytes_full"],
           "kv_bytes_kept": rep["kv_bytes_kept"], "uor_mean": m.get("uor_mean"), "uor_max": m.get("uor_max"),
           "evictions": rep["evictions"], "eviction_s": rep["eviction_s"], "guided_evictions": rep["guided_evictions"],
           "guide_s": rep["guide_s"], "reselected_tokens": rep["reselected_tokens"],
           "prefill_tok_s": n_prefill / max(t_pre, 1e-9),
           "decode_tok_s": n_dec / max(t_dec, 1e-9) if n_dec else 0.0, "recall": rep["recall"]}
    if args.json:
        print(json.dumps(out))
    else:
        mib = 1 << 20
        print(f"\n[{out['logical_tokens']} logical tokens, {out['kept_tokens']} kept in {out['kv_cells']} cells | "
              f"KV {out['kv_bytes_full'] / mib:.1f} MiB full vs {out['kv_bytes_kept'] / mib:.1f} MiB kept | "
              f"prefill {out['prefill_tok_s']:.0f} tok/s, decode {out['decode_tok_s']:.1f} tok/s]")
    return 0


def cmd_chat(args) -> int:
    llm = _load(args, None)
    messages: list[dict] = []
    interactive = sys.stdin.isatty()
    print("entrokv-edge chat: /save FILE, /load FILE, /stats, /quit", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            try:
                if cmd == "/quit":
                    break
                elif cmd == "/stats":
                    rep = llm.kv_report()
                    print(json.dumps({k: v for k, v in rep.items() if k != "layers"}))
                elif cmd == "/save" and arg:
                    llm.save_session(arg, extra={"messages": messages})
                    print(f"saved {arg}")
                elif cmd == "/load" and arg:
                    messages = llm.load_session(arg).get("messages", [])
                    print(f"loaded {arg} ({len(messages)} messages)")
                else:
                    print(f"unknown command {line!r}: /save FILE, /load FILE, /stats, /quit", file=sys.stderr)
            except (OSError, ValueError) as e:
                print(f"entrokv-edge: {e}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for chunk in llm.create_chat_completion(messages, max_tokens=args.max_tokens, temperature=args.temp,
                                                    stream=True):
                piece = chunk["choices"][0]["delta"].get("content", "") or ""
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ValueError as e:         # llama-cpp-python's refusal of a conversation longer than the context
            messages.pop()
            print(f"entrokv-edge: not answered: {e}", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _pages_map(positions, n: int, P: int, width: int = 96) -> list[str]:
    """One line per (layer, group): '#' where a page is kept ('+' partly, when pages are merged)."""
    import numpy as np
    L, G, _ = positions.shape
    n_pages = -(-n // P)
    kept = np.zeros((L, G, n_pages), dtype=bool)
    li, gi, _ = np.indices(positions.shape)
    kept[li, gi, positions // P] = True
    step = max(1, -(-n_pages // width))
    lines = []
    for l in range(L):
        for g in range(G):
            row = kept[l, g]
            cells = [row[i: i + step] for i in range(0, n_pages, step)]
            lines.append("".join("#" if c.all() else "+" if c.any() else "." for c in cells))
    return lines


def cmd_inspect(args) -> int:
    import numpy as np
    text = _prompt_text(args)
    n_prompt = _count_tokens(args, text)
    llm = _load(args, n_prompt)
    toks = llm.tokenize(text.encode())
    if len(toks) > llm.kv_cells - llm.reserve:
        raise CLIError(f"inspect evicts once, at the end of the prompt: {len(toks)} tokens need "
                       f"--kv-cells of at least {len(toks) + llm.reserve}")
    llm.eval(toks)
    if llm.last_eviction is None:
        raise CLIError("the budget keeps the whole prompt: nothing was evicted, so there is nothing to inspect")
    res = llm.last_eviction
    m, heads = res.metrics, res.metrics["heads"]
    P = m["page_size"]
    rmap = _pages_map(res.positions, len(toks), P)
    if args.png:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise CLIError("--png needs matplotlib: pip install 'entrokv-edge[plot]'")
        fig, ax = plt.subplots(1, 3, figsize=(15, 5))
        for a, key, title in ((ax[0], "collision_entropy", "collision entropy H2"), (ax[1], "weights", "head weight")):
            im = a.imshow(np.array(heads[key]), aspect="auto", cmap="viridis")
            a.set(title=title, xlabel="query head", ylabel="layer")
            fig.colorbar(im, ax=a)
        shade = {"#": 1.0, "+": 0.5, ".": 0.0}
        ax[2].imshow([[shade[c] for c in line] for line in rmap], aspect="auto", cmap="Greys", vmin=0, vmax=1,
                     interpolation="nearest")
        step = max(1, -(-(-(-len(toks) // P)) // 96))
        ax[2].set(title=f"{llm.config.policy}: kept pages (grey: partly)",
                  xlabel=f"page group ({step} page(s) of {P} tokens)", ylabel="layer x KV head")
        fig.tight_layout()
        fig.savefig(args.png, dpi=100)
    if args.json:
        print(json.dumps({"policy": llm.config.policy, "logical_tokens": m["logical_tokens"],
                          "kept_tokens": m["kept_tokens"], "uor_mean": m["uor_mean"], "uor_max": m["uor_max"],
                          "entropies": heads["collision_entropy"], "weights": heads["weights"],
                          "sink_masses": heads["sink_mass"], "masquerade_ratios": heads["masquerade_ratio"],
                          "retained_pages": rmap}))
        return 0
    H2, W, SM, MR = (np.array(heads[k]) for k in ("collision_entropy", "weights", "sink_mass", "masquerade_ratio"))
    print(f"{m['logical_tokens']} tokens, {m['kept_tokens']} kept per KV head ({llm.config.policy}); "
          f"head-independent UOR mean {m['uor_mean']:.3f} max {m['uor_max']:.3f}")
    print("layer  H2 per query head | weights | sink mass | masquerade ratio")
    for l in range(H2.shape[0]):
        fmt = lambda row, f: " ".join(format(v, f) for v in row)  # noqa: E731
        print(f"{l:5d}  {fmt(H2[l], '5.2f')} | {fmt(W[l], '4.2f')} | {fmt(SM[l], '4.2f')} | {fmt(MR[l], '5.2f')}")
    print("retained pages ('#' kept) per layer x KV head:")
    for line in rmap:
        print("  " + line)
    if args.png:
        print(f"figures written to {args.png}")
    return 0


def cmd_rpc_server(args) -> int:
    from .runtime.rpc import RPCUnavailableError, serve
    try:
        serve(f"{args.host}:{args.port}", n_threads=args.threads, cache_dir=args.cache_dir)
    except (RPCUnavailableError, ValueError) as e:
        raise CLIError(str(e))
    return 0


def cmd_serve(args) -> int:
    from .server import main as serve
    return serve(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .bindings import EntroKVError
    if not args.verbose:
        _quiet_llama()
    try:
        return {"run": cmd_run, "chat": cmd_chat, "inspect": cmd_inspect,
                "rpc-server": cmd_rpc_server, "serve": cmd_serve}[args.cmd](args)
    except CLIError as e:
        print(f"entrokv-edge: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EntroKVError as e:
        print(f"entrokv-edge: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
