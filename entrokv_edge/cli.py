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
import json
import sys
import time

import numpy as np
from tqdm import tqdm

from . import server
from .bindings import EntroKVError
from .controller.config import DEFAULT_BUDGET
from .launch import (EXIT_USAGE, CLIError, at_least, budget_value, cache_type_arg, count_tokens, finite, load_runtime,
                     quiet_llama, read_text)
from .runtime.rpc import RPCUnavailableError, serve as serve_rpc

DESCRIPTION = ("Answer a prompt, chat, serve or inspect a model's heads with a KV cache of bounded size: "
               "Page-EntroKV eviction inside llama.cpp.")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line on stderr and exit status 2, like every other
    refusal of the command (argparse's own prints the usage first)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"entrokv-edge: {message} (see {self.prog} --help)\n")


# the policies a user picks between on the command line; every other one (the baselines the method is compared
# with) stays reachable through --set policy=NAME
MAIN_POLICIES = ("entrokv-edge", "page-entrokv", "streaming", "full")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="entrokv-edge", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = _Parser(add_help=False)
    common.add_argument("-m", "--model", required=True, help="a .gguf file or a name from entrokv-models list")
    common.add_argument("--kv-cells", type=at_least(1), metavar="N", help="the KV cache, in tokens (default: the "
                        "prompt and the answer fit)")
    common.add_argument("--budget", type=budget_value, metavar="B", help="tokens each KV head keeps: a fraction of the "
                        f"prompt (0.2) or a count (512); default: what --kv-cells holds, else {DEFAULT_BUDGET}")
    common.add_argument("--policy", choices=MAIN_POLICIES, metavar="NAME", help="entrokv-edge (default), page-entrokv "
                        "(as published), streaming (sinks, recent), full (no eviction)")
    common.add_argument("--recall", nargs="?", const="full", choices=("turns", "full"), default=None,
                        help="evicted tokens kept, brought back at later turns (turns) or also while "
                        "generating (full, bare --recall)")
    common.add_argument("--no-recall", dest="recall", action="store_const", const=False, help=argparse.SUPPRESS)
    common.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other setting (docs/options.md), e.g. --set page_size=16; repeatable")
    common.add_argument("--config", metavar="FILE", help="settings from a JSON object (--set and flags win)")
    common.add_argument("-ctk", "--cache-type-k", type=cache_type_arg, metavar="TYPE", help="K's cache type: f16 "
                        "(default), q8_0, q4_0, ...")
    common.add_argument("-ctv", "--cache-type-v", type=cache_type_arg, metavar="TYPE", help="V's (quantized: needs -fa)")
    common.add_argument("-fa", "--flash-attn", choices=("on", "off", "auto"), default="auto",
                        help="flash attention (auto: on where V is quantized)")
    common.add_argument("--threads", type=at_least(1), metavar="N", help="CPU threads (default: llama.cpp's; at most 512)")
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
                           help="the answer's length at most (default 256; <= 0: no limit)")
            p.add_argument("--temp", type=finite, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)")
            p.add_argument("--raw", action="store_true", help="plain completion, no chat template")
        if name == "inspect":
            p.add_argument("--png", help="also write the figures to this PNG (needs matplotlib)")
    p = sub.add_parser("rpc-server", help="serve this machine's CPU to llama.cpp RPC clients")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback; the protocol "
                   "has no authentication: expose it only on a trusted network)")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--threads", type=at_least(1), help="CPU threads (default: all; at most 512)")
    p.add_argument("--cache-dir", help="keep received tensors here, so a model is sent once")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's logs")
    server.add_parser(sub, common)     # serve: its flags and its logic live in server/
    return ap


def _prompt_text(args) -> str:
    parts = []
    if getattr(args, "file", None):
        parts.append(read_text(args.file))
    if args.prompt:
        parts.append(args.prompt)
    text = "\n\n".join(p for p in parts if p.strip())
    if not text.strip():
        raise CLIError("the prompt is empty (give -p TEXT and/or -f FILE)")
    return text


def _progress_bar(enabled: bool):
    if not enabled:
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
    n_prompt = count_tokens(args, text)
    bar, update = _progress_bar(sys.stderr.isatty() and not args.json and n_prompt > 1024)
    llm = load_runtime(args, n_prompt)
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
    llm = load_runtime(args, None)
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
    text = _prompt_text(args)
    n_prompt = count_tokens(args, text)
    llm = load_runtime(args, n_prompt)
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
    try:
        serve_rpc(f"{args.host}:{args.port}", n_threads=args.threads, cache_dir=args.cache_dir)
    except (RPCUnavailableError, ValueError) as e:
        raise CLIError(str(e))
    return 0


def cmd_serve(args) -> int:
    return server.main(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.verbose:
        quiet_llama()
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
