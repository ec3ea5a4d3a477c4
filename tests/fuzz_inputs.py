"""Random damage to session files, and random command lines (see fuzzing.py)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

import entrokv_edge as ek
from entrokv_edge.runtime import session
from fuzzing import PROBE
from helpers import logits


# --- session files: random damage, and states re-signed after a change ----------------------

SESSION_SETTINGS = dict(budget=64, page_size=8, window=16, verbose=False, seed=0, n_threads=1, n_threads_batch=1)
ZIP_MARKS = re.compile(rb"PK\x03\x04|PK\x01\x02|PK\x05\x06|\x93NUMPY")


class SessionTarget:
    """A compacted conversation `a` saved to a file, and a second context `b` in the middle of its
    own, whose state every check puts back."""

    def __init__(self, path, tmp: Path):
        self.tmp = tmp
        self.a = ek.EntroKVLlama(str(path), n_ctx=256, **SESSION_SETTINGS)
        self.a.eval([int(t) for t in np.random.default_rng(1).integers(3, 300, 600)])
        self.file = tmp / "chat.entrokv"
        self.a.save_session(self.file)
        self.data = self.file.read_bytes()
        self.marks = [m.start() for m in ZIP_MARKS.finditer(self.data)]
        self.b = ek.EntroKVLlama(str(path), n_ctx=256, **SESSION_SETTINGS)
        self.b.eval([int(t) for t in np.random.default_rng(2).integers(3, 300, 300)])
        self.b_state = self.b.save_state()
        self.b_now = (logits(self.b), ek.true_positions(self.b), self.b.n_tokens)
        self.b.eval([PROBE])
        self.b_next = logits(self.b)
        self.b.load_state(self.b_state)

    def assert_b_unchanged(self) -> None:
        lg, tp, n = self.b_now
        assert self.b.n_tokens == n and np.array_equal(ek.true_positions(self.b), tp)
        assert np.array_equal(logits(self.b), lg)
        self.b.eval([PROBE])
        assert np.array_equal(logits(self.b), self.b_next), "the context no longer decodes as before"

    def load(self, file: Path) -> str:
        """Load file into b: a SessionError must leave b as it was; a load must give a's state."""
        try:
            try:
                self.b.load_session(file)
                got = "loaded"
            except ek.SessionError:
                got = "SessionError"
            if got == "loaded":
                assert self.b.n_tokens == self.a.n_tokens and np.array_equal(logits(self.b), logits(self.a))
                assert np.array_equal(ek.true_positions(self.b), ek.true_positions(self.a))
            else:
                self.assert_b_unchanged()
        finally:
            self.b.load_state(self.b_state)
        return got


@st.composite
def damaged_files(draw, data: bytes, marks: list):
    """The file with bits flipped (anywhere, or in a zip or .npy header), cut short, with bytes
    appended or zeroed, or replaced by random bytes."""
    kind = draw(st.sampled_from(["flip", "flip header", "truncate", "append", "zero", "random"]))
    b = bytearray(data)
    if kind in ("flip", "flip header"):
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.integers(0, len(b) - 1)) if kind == "flip" else \
                min(len(b) - 1, draw(st.sampled_from(marks)) + draw(st.integers(0, 120)))
            b[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        del b[draw(st.integers(0, len(b) - 1)):]
    elif kind == "append":
        b += draw(st.binary(min_size=1, max_size=64))
    elif kind == "zero":
        at = draw(st.integers(0, len(b) - 1))
        b[at: at + draw(st.integers(1, 512))] = bytes(min(len(b) - at, 512))[: len(b[at: at + 512])]
    else:
        b = bytearray(draw(st.binary(max_size=512)))
    return kind, bytes(b)


def check_damaged(t: SessionTarget, kind: str, data: bytes) -> str:
    f = t.tmp / "damaged.entrokv"
    f.write_bytes(data)
    return f"{kind}: {t.load(f)}"


RESIGNED = ("n_tokens short", "n_tokens long", "token ids", "true_pos values", "true_pos shape", "logits size",
            "window scores shape", "window scores values", "window scores position", "settings", "identity",
            "llama_state cut")


def _resign(st_, defect: str, rng) -> None:
    """Change one field of a state the way no save of ours would (the file is then re-signed)."""
    k = int(rng.integers(1, 20))
    ws = st_.window_scores
    if defect == "n_tokens short":
        st_.n_tokens -= k
        st_.input_ids = st_.input_ids[: st_.n_tokens]
    elif defect == "n_tokens long":
        st_.n_tokens += k
        st_.input_ids = np.concatenate([st_.input_ids, rng.integers(3, 300, k).astype(np.int32)])
    elif defect == "token ids":
        st_.input_ids = st_.input_ids.copy()
        st_.input_ids[rng.integers(st_.input_ids.size)] = rng.choice([-1, 10**6, 2**31 - 1])
    elif defect == "true_pos values":
        st_.true_pos = rng.integers(-5, 10**4, st_.true_pos.shape).astype(np.int32)
    elif defect == "true_pos shape":
        st_.true_pos = np.zeros((st_.true_pos.shape[0] + 1, 3), np.int32)
    elif defect == "logits size":
        st_.logits = st_.logits[:-k]
    elif defect == "window scores shape":
        ws.scores = ws.scores[:, :-1]
    elif defect == "window scores values":
        ws.scores = ws.scores.copy()
        ws.scores.flat[rng.integers(ws.scores.size)] = rng.choice([np.nan, np.inf, -1.0])
    elif defect == "window scores position":
        ws.pos_last = st_.n_tokens + k
    elif defect == "settings":
        st_.settings = {**st_.settings, "budget": -k}
    elif defect == "identity":
        st_.identity = {**st_.identity, "model": "0" * 64}
    elif defect == "llama_state cut":
        st_.llama_state = st_.llama_state[: -k * 100]


def check_resigned(t: SessionTarget, defect: str, seed: int) -> str:
    """A well-formed file (checksums right) whose content does not fit: refused, b unchanged."""
    st_ = session.read(t.file)
    _resign(st_, defect, np.random.default_rng(seed))
    f = t.tmp / "resigned.entrokv"
    session.write(f, st_)
    got = t.load(f)
    assert got == "SessionError", f"a re-signed state with {defect} was loaded"
    return defect


# --- the command line: random arguments and input files, in-process --------------------------

VALUES = ["0", "1", "2", "3", "16", "32", "64", "-1", "-7", "0.2", "1.0", "1.5", "-0.5", "1e-9", "nan", "inf", "-inf",
          "1e400", "2147483648", "99999999999999999999", "-99999999999", "abc", "", "0x10", "\u00e9"]
OPTIONS = {"--kv-cells": VALUES, "--budget": VALUES, "--threads": VALUES + ["513", "100000"],
           "--max-tokens": ["1", "2", "4", "0", "-3", "10**12"], "--temp": VALUES, "--n-gpu-layers": ["0", "-1", "5"],
           "--policy": ["page-entrokv", "streaming", "full", "best"]}
# the research settings, through --set KEY=VALUE (an unknown key and a bare key among them)
SETTINGS = {"page_size": VALUES, "window": VALUES, "sinks": VALUES, "recent": VALUES, "tau": VALUES, "pool": VALUES,
            "spread": VALUES, "decay": VALUES, "value_power": VALUES, "lookahead": VALUES, "lookahead_share": VALUES,
            "consensus": VALUES, "guide": VALUES, "guide_share": VALUES, "guide_draft": VALUES, "guide_consensus": VALUES,
            "entropy_region": ["sinks", "evictable", "none"], "head_pool": ["rank", "max", "sum"],
            "policy": ["mean-pool", "snapkv", "h2o", "best"], "pages": ["4"], "budget": VALUES}
FILES = {"empty": b"", "blank": b" \n\t\n", "binary": bytes(range(256)), "latin-1": "caf\u00e9 cr\u00e8me".encode("latin-1"),
         "text": b"the quick brown fox jumps over the lazy dog. " * 8, "long": b"abc def ghi jkl " * 400}


class CLIFiles:
    """A synthetic model with a short context (256 tokens, so that an unlimited answer ends soon),
    the input files above, a file that is not a model."""

    def __init__(self, tmp: Path):
        from synth import write_model
        self.model = write_model(tmp / "cli.gguf", n_ctx_train=256, seed=11)
        self.files = {}
        for name, data in FILES.items():
            (tmp / name).write_bytes(data)
            self.files[name] = str(tmp / name)
        self.files["missing"] = str(tmp / "nope.txt")
        self.files["directory"] = str(tmp)
        (tmp / "notgguf.gguf").write_text("hello")
        self.models = {"synthetic": str(self.model), "not gguf": str(tmp / "notgguf.gguf"),
                       "missing": str(tmp / "none.gguf"), "unknown name": "no-such-model"}


@st.composite
def cli_args(draw, t: CLIFiles):
    """argv for `entrokv-edge run|inspect|chat` (and a stdin for chat): mostly the synthetic model,
    a prompt and/or a file, then up to four options with random values."""
    cmd = draw(st.sampled_from(["run", "run", "run", "inspect", "chat"]))
    model = draw(st.sampled_from(["synthetic"] * 6 + list(t.models)))
    argv = [cmd, "-m", t.models[model]]
    if cmd != "chat":
        if draw(st.booleans()):
            argv += ["-f", t.files[draw(st.sampled_from(sorted(t.files)))]]
        argv += ["-p", draw(st.sampled_from(["a short question?", "", "   ", "x" * 3, "\u00fcber"]))]
    opts = draw(st.lists(st.sampled_from(sorted(OPTIONS) + sorted(SETTINGS)), max_size=4, unique=True))
    for opt in opts:
        if opt in OPTIONS:
            argv.append(f"{opt}={draw(st.sampled_from(OPTIONS[opt]))}")
        else:
            value = draw(st.sampled_from(SETTINGS[opt]))
            argv += ["--set", opt if draw(st.integers(0, 9)) == 0 else f"{opt}={value}"]
    if draw(st.integers(0, 4)) == 0:
        argv += ["--config", t.files[draw(st.sampled_from(sorted(t.files)))]]
    if draw(st.booleans()):        # settings a short prompt on this model accepts, unless drawn above
        if "--budget" not in opts:
            argv.append("--budget=0.5")
        argv += ["--set", "window=4"] if "window" not in opts else []
        argv += ["--set", "page_size=2"] if "page_size" not in opts else []
    if "--max-tokens" not in opts and cmd != "inspect":
        argv.append("--max-tokens=2")
    return argv, draw(st.sampled_from(["hello\n/quit\n", "", "/stats\n/bogus\n/load /nonexistent\n"]))


def _refusal_kind(line: str) -> str:
    msg = re.sub(r"/\S+", "PATH", line.removeprefix("entrokv-edge: "))
    if msg.startswith("argument "):
        return "usage: " + msg.split(":")[0].removeprefix("argument ")
    return "refused: " + " ".join(re.sub(r"\S*\d\S*", "N", msg).split()[:4])


def check_cli(argv: list, stdin: str) -> str:
    """main(argv) in this process: exit status 0, or 2 with one line on stderr ('entrokv-edge: ...')
    and nothing on stdout; any exception is a failure (it would be a traceback)."""
    import contextlib
    import io
    import sys
    from entrokv_edge import cli
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:
                rc = e.code
    finally:
        sys.stdin = old_stdin
    text = err.getvalue()
    assert "Traceback" not in text, text
    if rc == 0:
        return "ok"
    lines = text.strip().splitlines()
    if argv[0] == "chat" and lines and lines[0].startswith("entrokv-edge chat:"):
        lines = lines[1:]                      # the chat's greeting, before its refusal
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("entrokv-edge: "), (argv, rc, text)
    assert out.getvalue() == "", (argv, out.getvalue())
    return _refusal_kind(lines[0])
