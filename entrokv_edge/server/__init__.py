"""``entrokv-edge serve``: an OpenAI-compatible HTTP server (``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``, streaming or not) on one EntroKVLlama, through
llama-cpp-python's own server stack (its ``[server]`` extra; ours: ``pip install -e ".[server]"``).
Conversations longer than the cache work as they do in Python; the compressed states of recent
conversations are kept, so a returning conversation goes on without re-reading its history; every
answer carries an ``entrokv`` field with its KV figures. See docs/server.md.

This package: the command (here), app.py (the app on llama-cpp-python's server stack, and what it relies
on in llama-cpp-python 0.3.36), door.py (admission and request checks), defaults.py.
"""
from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading
from pathlib import Path

from ..bindings import EntroKVError
from ..launch import CLIError, at_least, finite, load_runtime, model_file
from .defaults import (DEFAULT_CONVERSATIONS, DEFAULT_CONVERSATIONS_MIB, DEFAULT_MAX_BODY_KIB, DEFAULT_MAX_TOKENS_CAP,
                       DEFAULT_PORT, DEFAULT_QUEUE)

INSTALL_HINT = 'pip install -e ".[server]" (from a clone) or pip install "entrokv-edge[server]"'


SAFETY = ("Beyond loopback: give --api-key KEY or --api-key-file FILE (every route then asks for "
          "'Authorization: Bearer KEY'), put a TLS proxy in front, and bound requests with --max-tokens-cap and "
          "--max-body-kib; --host other than loopback without a key is refused unless --no-auth is given.")


def add_parser(sub, common) -> None:
    """The ``serve`` subcommand; ``common`` holds the model and eviction flags ``run`` has."""
    p = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server",
                       description="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, "
                                   "/health, /metrics). " + SAFETY)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback; another address "
                   "needs --api-key, --api-key-file or --no-auth)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0: a free one")
    p.add_argument("--api-key", metavar="KEY", help="require this key ('Authorization: Bearer KEY') on every route")
    p.add_argument("--api-key-file", metavar="FILE", help="require one of the keys in FILE (one a line; blank lines "
                   "and lines starting with # are skipped)")
    p.add_argument("--no-auth", action="store_true", help="serve beyond loopback without a key, on purpose")
    p.add_argument("--conversations", type=at_least(0), default=DEFAULT_CONVERSATIONS,
                   help=f"saved conversation states kept (default {DEFAULT_CONVERSATIONS}; 0: none)")
    p.add_argument("--conversations-mib", type=finite, default=DEFAULT_CONVERSATIONS_MIB,
                   help=f"memory for saved conversation states, MiB (default {DEFAULT_CONVERSATIONS_MIB})")
    p.add_argument("--queue", type=at_least(0), default=DEFAULT_QUEUE,
                   help=f"requests that may wait while one generates; more get 503 (default {DEFAULT_QUEUE})")
    p.add_argument("--max-tokens-cap", type=at_least(1), default=DEFAULT_MAX_TOKENS_CAP, metavar="N",
                   help=f"the most tokens a request may ask for (default {DEFAULT_MAX_TOKENS_CAP}; more: 400; none "
                        "asked: this)")
    p.add_argument("--max-body-kib", type=at_least(1), default=DEFAULT_MAX_BODY_KIB, metavar="N",
                   help=f"the largest request body, KiB (default {DEFAULT_MAX_BODY_KIB}; larger: 413)")


def _listen(host: str, port: int) -> socket.socket:
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def _keys(args) -> list[str]:
    """The API keys of --api-key and --api-key-file (CLIError for an unreadable or empty file; the keys themselves
    never appear in a message)."""
    keys = []
    if args.api_key is not None:
        if not args.api_key.strip() or any(c.isspace() for c in args.api_key.strip()):
            raise CLIError("--api-key: a key must be non-empty and hold no spaces")
        keys.append(args.api_key.strip())
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                lines = [ln.strip() for ln in f]
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read --api-key-file {args.api_key_file}: {getattr(e, 'strerror', None) or e}")
        got = [ln for ln in lines if ln and not ln.startswith("#")]
        if not got or any(any(c.isspace() for c in k) for k in got):
            raise CLIError(f"--api-key-file {args.api_key_file}: expected one key a line (no spaces), found none")
        keys += got
    return keys


def _loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def main(args) -> int:
    """Serve until SIGINT or SIGTERM (then exit status 0). The port answers at once: ``/health`` says 503 while
    the model loads (in a thread beside the server), 200 once it is loaded; a model that cannot be loaded ends
    the server with its one-line message (exit status 2)."""
    try:
        import uvicorn
        from .app import ROUTES, build_app
        from .door import Door
    except ImportError as e:
        raise CLIError(f"serve needs the server extra ({e.name or e} is missing): {INSTALL_HINT}")
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if min(args.conversations, args.conversations_mib, args.queue) < 0:
        raise CLIError("--conversations, --conversations-mib and --queue must be >= 0")
    keys = _keys(args)
    if not keys and not args.no_auth and not _loopback(args.host):
        raise CLIError(f"--host {args.host} serves anyone who can reach the port: give --api-key KEY or --api-key-file "
                       "FILE, or --no-auth to serve without a key on purpose")
    model_file(args.model)                         # a missing or non-GGUF file fails at once, before serving
    sock = _listen(args.host, args.port)          # before the model loads: a busy port fails at once
    door = Door(ROUTES, args.queue, keys, args.max_body_kib << 10, args.max_tokens_cap)
    alias = Path(args.model).name.removesuffix(".gguf")
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(door, log_level="info" if args.verbose else "warning", access_log=args.verbose,
                            timeout_graceful_shutdown=5, lifespan="off")
    server = uvicorn.Server(config)
    state: dict = {"llm": None, "app": None, "error": None}

    def load() -> None:
        try:
            llm = state["llm"] = load_runtime(args, None)
            if isinstance(llm.config.budget, int) and llm.config.budget > llm.kv_cells - llm.reserve:
                raise CLIError(f"budget of {llm.config.budget} tokens is above what a {llm.kv_cells}-cell cache can "
                               f"keep ({llm.kv_cells - llm.reserve}, leaving room for new tokens); lower --budget or "
                               "raise --kv-cells")
            state["app"] = build_app(llm, alias, door, args.conversations, args.conversations_mib)
            print(f"entrokv-edge serve: {alias} ready on http://{host}:{port}/v1 ({llm.kv_cells} KV cells, up to "
                  f"{args.conversations} saved conversations in {args.conversations_mib:g} MiB"
                  f"{', API key required' if keys else ''})", file=sys.stderr, flush=True)
        except BaseException as e:      # noqa: BLE001 - reported by main, once the server has stopped
            state["error"] = e
            server.should_exit = True

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again with the
    # handlers it found: ours let main return 0 (Python's would exit 130 or die by SIGTERM)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    loader = threading.Thread(target=load, name="entrokv-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        loader.join()
        if state["app"] is not None:
            state["app"].state.end_streams()      # a stream cut by the shutdown may still be in a worker thread
        if state["llm"] is not None:
            state["llm"].close()
    e = state["error"]
    if isinstance(e, CLIError):
        raise e
    if isinstance(e, EntroKVError):
        raise CLIError(str(e))
    if e is not None:
        raise e
    return 0
