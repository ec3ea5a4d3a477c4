"""llama.cpp's RPC backend: serve this machine's CPU to others, or use remote servers.

A model's layers (and their part of the KV cache) can live on ggml RPC servers; the
observation scores and the compaction then run there, through the ggml graph path.
Needs a build with ``-DGGML_RPC=ON`` (README, "GPU and multi-host use").

ggml's RPC protocol has no authentication and no encryption: serve on loopback or on a
network you trust. ggml aborts the whole process when a registered server disappears, so
a client process should not outlive its servers.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading

from .._loader import ensure_llama_cpp
from .._paths import lib_dir
from .host import MAX_THREADS

_registered: dict[str, list[str]] = {}
_lock = threading.Lock()


class RPCUnavailableError(RuntimeError):
    """This build has no RPC backend, or an RPC server cannot be reached."""


def supported() -> bool:
    """True when the patched llama.cpp was built with the RPC backend."""
    return bool(ensure_llama_cpp().llama_supports_rpc()) and (lib_dir() / "libggml-rpc.so").exists()


def _libs():
    if not supported():
        raise RPCUnavailableError("this build of EntroKV Edge has no RPC backend: reinstall with "
                                  "CMAKE_ARGS=\"-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DGGML_RPC=ON\" (README)")
    ggml = ctypes.CDLL(str(lib_dir() / "libggml.so"))
    rpc = ctypes.CDLL(str(lib_dir() / "libggml-rpc.so"))
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_register.restype = None
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    ggml.ggml_backend_dev_name.restype = ctypes.c_char_p
    ggml.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    return ggml, rpc


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); ValueError for anything else (ggml's RPC takes
    IPv4 addresses and host names, not IPv6 literals)."""
    host, sep, port = str(endpoint).partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"RPC endpoint {endpoint!r} is not host:port (e.g. 127.0.0.1:50052)")
    return host, int(port)


def add_servers(endpoints, timeout: float = 5.0) -> list[str]:
    """Register RPC servers with ggml, so that models loaded afterwards offload to them.

    ``endpoints``: "host:port" or a list of them. Each server is first reached with a
    plain TCP connection (``timeout`` seconds): ggml itself aborts the process when a
    server cannot be reached. Returns the ggml device names ("RPC0", ...), in the order
    llama.cpp fills them (RPC devices come before local GPUs). Registering the same
    endpoint again is a no-op.
    """
    if isinstance(endpoints, str):
        endpoints = [endpoints]
    endpoints = list(endpoints)
    for ep in endpoints:
        parse_endpoint(ep)
    ggml, rpc = _libs()
    names: list[str] = []
    with _lock:
        for ep in endpoints:
            if ep in _registered:
                names += _registered[ep]
                continue
            host, port = parse_endpoint(ep)
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as e:
                raise RPCUnavailableError(f"RPC server {ep} cannot be reached: {e}") from None
            reg = rpc.ggml_backend_rpc_add_server(ep.encode())
            if not reg or ggml.ggml_backend_reg_dev_count(reg) == 0:
                raise RPCUnavailableError(f"RPC server {ep} offers no device")
            ggml.ggml_backend_register(reg)
            devs = [ggml.ggml_backend_dev_name(ggml.ggml_backend_reg_dev_get(reg, i)).decode()
                    for i in range(ggml.ggml_backend_reg_dev_count(reg))]
            _registered[ep] = devs
            names += devs
    return names


def serve(endpoint: str = "127.0.0.1:50052", n_threads: int | None = None, cache_dir: str | None = None) -> None:
    """Serve this machine's CPU backend on ``endpoint`` (blocks until the process ends).

    ``cache_dir``: where the server may keep tensors it received before (ggml's local
    cache, so a model is sent once). Raises RPCUnavailableError if the port cannot be
    bound.
    """
    host, port = parse_endpoint(endpoint)
    if n_threads is not None and not 1 <= n_threads <= MAX_THREADS:
        raise ValueError(f"n_threads must be in 1..{MAX_THREADS}, got {n_threads}")
    ggml, rpc = _libs()
    with socket.socket(socket.AF_INET) as s:
        try:   # ggml prints and returns on a busy port; say so in our words first
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError as e:
            raise RPCUnavailableError(f"cannot serve on {endpoint}: {e}") from None
    cpu = ggml.ggml_backend_dev_by_type(0)   # GGML_BACKEND_DEVICE_TYPE_CPU
    if not cpu:
        raise RPCUnavailableError("no CPU device in this ggml build")
    devs = (ctypes.c_void_p * 1)(cpu)
    n = int(n_threads or os.cpu_count() or 1)
    if threading.current_thread() is threading.main_thread():
        # the server blocks inside C: let Ctrl-C and SIGTERM end the process at once
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache_dir.encode() if cache_dir else None, n, 1, devs)
    raise RPCUnavailableError(f"the RPC server on {endpoint} stopped")
