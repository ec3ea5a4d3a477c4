"""What the command line and the server both need to start a model: argument types, settings from
flags and files, the model loaded as an EntroKVLlama, and ``CLIError`` (a user error: one line, exit
status 2)."""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import typing
from pathlib import Path

from ._loader import ensure_llama_cpp
from .bindings import EntroKVError
from .controller import EvictionConfig
from .controller.config import DEFAULT_BUDGET
from .models import ModelError, model_path
from .runtime import EntroKVLlama
from .runtime.eviction import cells_to_hold, reserved_cells
from .runtime.host import CACHE_TYPES, QUANTIZED
from .runtime.rpc import RPCUnavailableError, add_servers

llama_cpp = ensure_llama_cpp()

EXIT_USAGE = 2
MAX_TEXT_BYTES = 16 << 20       # a -f file larger than this is refused (a model's whole context is far less)


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def budget_value(text: str):
    try:
        v = finite(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"budget must be a fraction (0.2) or a token count (512), got {text!r}")
    return v if ("." in text or "e" in text.lower()) else int(v)


def at_least(lo: int):
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


def read_text(path: str) -> str:
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


def model_file(name: str) -> Path:
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


def quiet_llama() -> None:
    """Silence llama.cpp's own logging (the default without --verbose)."""
    global _LOG_CB
    _LOG_CB = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


def parse_value(key: str, text: str):
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
            return budget_value(text)
        except argparse.ArgumentTypeError as e:
            raise CLIError(f"--set budget: {e}")
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                raise CLIError(f"--set {key}: expected {'an integer' if kind is int else 'a number'}, got {text!r}")
    return text


def settings_of(args) -> dict:
    """The EvictionConfig of args: --config's file, then --set, then --budget and --policy."""
    fields = {f.name for f in dataclasses.fields(EvictionConfig)}
    given: dict = {}
    if getattr(args, "config", None):
        try:
            data = json.loads(read_text(args.config))
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
        given[key] = parse_value(key, value.strip())
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


def load_runtime(args, n_prompt: int | None):
    """An EntroKVLlama for args; n_prompt (tokens) sizes the default cache and checks the budget."""
    cache = cache_kwargs(args)          # the flags' own refusals first
    path = model_file(args.model)
    settings = settings_of(args)
    cfg = settings["eviction"]
    max_new = max(getattr(args, "max_tokens", 0) or 0, 0)
    n_ctx = context_length(args)
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
    batch = batch_size(args, cells, cfg)
    kwargs = dict(n_ctx=cells, n_batch=batch, n_ubatch=batch, verbose=args.verbose, n_gpu_layers=args.n_gpu_layers)
    if args.rpc:
        try:
            add_servers(args.rpc)
        except (RPCUnavailableError, ValueError) as e:
            raise CLIError(str(e))
    kwargs.update(cache)
    if args.threads:
        kwargs.update(n_threads=args.threads, n_threads_batch=args.threads)
    if args.recall is not None:
        kwargs["recall"] = args.recall            # "turns", "full" or False: recall_config reads them
    try:
        return EntroKVLlama(str(path), **settings, **kwargs)
    except EntroKVError as e:
        raise CLIError(f"{path.name}: this model is not supported ({e.message})")
    except ValueError as e:
        msg = str(e)
        if "Failed to load model" in msg:
            raise CLIError(f"{path}: llama.cpp could not load this model (corrupt or unsupported architecture)")
        if "Failed to create llama_context" in msg:
            ck = {v: k for k, v in CACHE_TYPES.items()}
            raise CLIError(f"llama.cpp could not make a {cells}-cell cache of K {ck[kwargs['type_k']]}, V "
                           f"{ck[kwargs['type_v']]} (flash attention {'on' if kwargs['flash_attn'] else 'off'}) "
                           "for this model on this build; try another cache type, or f16")
        raise CLIError(msg)


def cache_type_arg(text: str) -> str:
    """An argparse type: a KV cache type's name (llama.cpp's spelling)."""
    if text.lower() not in CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"unknown cache type {text!r}; choose one of {', '.join(CACHE_TYPES)}")
    return text.lower()


def cache_kwargs(args) -> dict:
    """type_k, type_v and flash_attn for -ctk / -ctv / -fa: flash attention on with auto where V is quantized
    (llama.cpp needs it there); a quantized V with -fa off refused."""
    k = getattr(args, "cache_type_k", None) or "f16"
    v = getattr(args, "cache_type_v", None) or "f16"
    fa = getattr(args, "flash_attn", "auto")
    if v in QUANTIZED and fa == "off":
        raise CLIError(f"a quantized V cache ({v}) needs flash attention: give -fa on (or leave it auto)")
    return {"type_k": CACHE_TYPES[k], "type_v": CACHE_TYPES[v], "flash_attn": fa == "on" or (fa == "auto" and v in QUANTIZED)}


def vocab(args):
    """The model's vocabulary and header (a vocab-only llama_cpp.Llama), loaded once per command."""
    if getattr(args, "_vocab", None) is None:
        path = model_file(args.model)
        try:
            args._vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=args.verbose)
        except ValueError:
            raise CLIError(f"{path}: llama.cpp could not load this model (corrupt or unsupported architecture)")
    return args._vocab


def batch_size(args, cells: int, cfg) -> int:
    """n_batch and n_ubatch for a cache of ``cells``: 512, or less on a model with sliding-window
    layers (GGUF key <arch>.attention.sliding_window), whose cache keeps the last n_swa tokens plus
    a ubatch in as many cells as the base cache: the largest multiple of 32 that fits beside n_swa.
    A ubatch must hold the observed window: a cache too small for that is refused here."""
    meta = vocab(args).metadata
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


def context_length(args) -> int:
    """The model's training context (GGUF key <arch>.context_length; a vocab-only model has no
    hyperparameters): the longest conversation EntroKVLlama accepts."""
    meta = vocab(args).metadata
    try:
        return int(meta[f"{meta['general.architecture']}.context_length"])
    except (KeyError, ValueError):
        raise CLIError(f"{args.model}: the model file does not give its context length")


def count_tokens(args, text: str) -> int:
    n = len(vocab(args).tokenize(text.encode()))
    return n + (0 if getattr(args, "raw", True) else 32)   # the chat template's own tokens
