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

import signal
import socket
import sys
import threading
from pathlib import Path

from ..launch import CLIError, at_least, finite, load_runtime
from .defaults import DEFAULT_CONVERSATIONS, DEFAULT_CONVERSATIONS_MIB, DEFAULT_PORT, DEFAULT_QUEUE

INSTALL_HINT = 'pip install -e ".[server]" (from a clone) or pip install "entrokv-edge[server]"'


def add_parser(sub, common) -> None:
    """The ``serve`` subcommand; ``common`` holds the model and eviction flags ``run`` has."""
    p = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback; no authentication)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0: a free one")
    p.add_argument("--conversations", type=at_least(0), default=DEFAULT_CONVERSATIONS,
                   help=f"saved conversation states kept (default {DEFAULT_CONVERSATIONS}; 0: none)")
    p.add_argument("--conversations-mib", type=finite, default=DEFAULT_CONVERSATIONS_MIB,
                   help=f"memory for saved conversation states, MiB (default {DEFAULT_CONVERSATIONS_MIB})")
    p.add_argument("--queue", type=at_least(0), default=DEFAULT_QUEUE,
                   help=f"requests that may wait while one generates; more get 503 (default {DEFAULT_QUEUE})")


def _listen(host: str, port: int) -> socket.socket:
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def main(args) -> int:
    """Serve until SIGINT or SIGTERM (then exit status 0)."""
    try:
        import uvicorn
        from .app import build_app
    except ImportError as e:
        raise CLIError(f"serve needs the server extra ({e.name or e} is missing): {INSTALL_HINT}")
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if min(args.conversations, args.conversations_mib, args.queue) < 0:
        raise CLIError("--conversations, --conversations-mib and --queue must be >= 0")
    sock = _listen(args.host, args.port)          # before the model loads: a busy port fails at once
    llm = app = None
    try:
        llm = load_runtime(args, None)
        if isinstance(llm.config.budget, int) and llm.config.budget > llm.kv_cells - llm.reserve:
            raise CLIError(f"budget of {llm.config.budget} tokens is above what a {llm.kv_cells}-cell cache can keep "
                           f"({llm.kv_cells - llm.reserve}, leaving room for new tokens); lower --budget or raise --kv-cells")
        alias = Path(args.model).name.removesuffix(".gguf")
        app = build_app(llm, alias, args.conversations, args.conversations_mib, args.queue)
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"entrokv-edge serve: {alias} on http://{host}:{port}/v1 ({llm.kv_cells} KV cells, "
              f"up to {args.conversations} saved conversations in {args.conversations_mib:g} MiB)",
              file=sys.stderr, flush=True)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again with the
        # handlers it found: ours let main return 0 (Python's would exit 130 or die by SIGTERM)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
        config = uvicorn.Config(app, log_level="info" if args.verbose else "warning", access_log=args.verbose,
                                timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        if app is not None:
            app.state.end_streams()      # a stream cut by the shutdown may still be in a worker thread
        if llm is not None:
            llm.close()
    return 0
