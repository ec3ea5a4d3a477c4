"""The entrokv-edge command, run as a real process."""
import json
import subprocess
import sys

import pytest

from entrokv_edge.controller.config import EDGE_DEFAULTS

ZEN_LINES = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
             "Complex is better than complicated.", "Flat is better than nested.", "Sparse is better than dense."]


def cli(*args, stdin=None, timeout=300):
    r = subprocess.run([sys.executable, "-m", "entrokv_edge", *map(str, args)], capture_output=True, text=True,
                       input=stdin, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    p = tmp_path_factory.mktemp("doc") / "doc.txt"
    p.write_text("\n".join(f"Line {i}: {ZEN_LINES[i % 6]}" for i in range(150)))
    return p


def test_run_prints_the_answer_and_a_stats_line(smollm2, doc):
    rc, out, err = cli("run", "-m", smollm2, "-f", doc, "-p", "Which line is first?", "--kv-cells", 1024,
                       "--budget", 0.2, "--max-tokens", 12)
    assert rc == 0, err
    answer, stats = out.rstrip().rsplit("\n", 1)
    assert answer.strip() and "logical tokens" in stats and "kept in 1024 cells" in stats and "tok/s" in stats
    assert "Traceback" not in err and "llama_" not in err          # llama.cpp quiet by default


def test_run_json_has_the_fields_scripts_use(smollm2, doc):
    rc, out, err = cli("run", "-m", smollm2, "-f", doc, "-p", "Which line is first?", "--kv-cells", 1024, "--json",
                       "--max-tokens", 8, "--policy", "page-entrokv")
    assert rc == 0, err
    d = json.loads(out)
    for k in ("answer", "policy", "logical_tokens", "kept_tokens", "kv_cells", "kv_bytes_full", "kv_bytes_kept",
              "uor_mean", "uor_max", "prefill_tok_s", "decode_tok_s"):
        assert k in d, k
    assert d["kv_cells"] == 1024 and d["kept_tokens"] < d["logical_tokens"] and d["kv_bytes_kept"] < d["kv_bytes_full"]
    assert 1.0 <= d["uor_mean"] <= d["uor_max"] <= 3.0 and d["policy"] == "page-entrokv"


def test_run_recall_flag_turns_the_store_on_and_off(smollm2, doc):
    common = ["run", "-m", smollm2, "-f", doc, "-p", "Which line is first?", "--kv-cells", 1024, "--budget", 0.2,
              "--json", "--max-tokens", 8]
    rc, out, err = cli(*common, "--recall")
    assert rc == 0, err
    rec = json.loads(out)["recall"]
    assert rec["on"] and rec["where"] == "memory" and rec["store_tokens_per_group"] > 0 and rec["recalls"] >= 1
    rc, out, err = cli(*common, "--recall", "turns")       # a single prompt: a store, but no recall
    assert rc == 0, err
    rec = json.loads(out)["recall"]
    assert rec["on"] and rec["where"].startswith("file in ") and rec["store_tokens_per_group"] > 0
    assert rec["recalls"] == 0
    for flag in (("--no-recall",), ()):
        rc, out, err = cli(*common, *flag)
        assert rc == 0, err
        assert json.loads(out)["recall"] == {"on": False}
    rc, out, err = cli(*common, "--recall", "sometimes")
    assert rc == 2 and "invalid choice" in err and "Traceback" not in err


def test_run_with_entrokv_edge_keeps_the_same_budget(smollm2, doc, tmp_path):
    """Research settings through --set and --config: same kept tokens for every exact-budget policy."""
    common = ["run", "-m", smollm2, "-f", doc, "-p", "Which line is first?", "--kv-cells", 1024, "--json",
              "--max-tokens", 8]
    runs = {}
    P = EDGE_DEFAULTS["page_size"]          # entrokv-edge's default page size; the others at the same size
    settings = tmp_path / "edge.json"
    settings.write_text(json.dumps({"pool": 3, "spread": 4, "decay": 0.8, "consensus": 0.5, "entropy_region": "sinks",
                                    "value_power": 2, "lookahead": 4}))
    for extra in (["--policy", "page-entrokv", "--set", f"page_size={P}"], ["--policy", "entrokv-edge"],
                  ["--policy", "entrokv-edge", "--set", f"page-size={P}", "--config", settings,
                   "--set", "lookahead_share=0.7"],
                  ["--set", "policy=max-pool", "--set", f"page_size={P}"]):
        rc, out, err = cli(*common, *extra)
        assert rc == 0, err
        runs[" ".join(map(str, extra))] = json.loads(out)
    kept = {d["kept_tokens"] for d in runs.values()}
    assert len(kept) == 1 and {d["policy"] for d in runs.values()} == {"page-entrokv", "entrokv-edge", "max-pool"}
    assert all(d["answer"].strip() for d in runs.values())


@pytest.mark.parametrize("extra", [[], ["--set", "value_power=2"], ["--set", "lookahead=8"],
                                   ["--set", "reselect=false"]])
def test_a_prompt_longer_than_the_cache_runs(smollm2, doc, extra):
    """Evictions between chunks of the prompt: every one after the first works on a cache that
    was evicted before (value_power: the norms mapped from cells to true positions; lookahead:
    the draft after the prompt's last piece, on a cache evicted before). The eviction after the
    prompt chooses among the tokens earlier ones set aside too, unless reselect is off (or
    value_power is on, whose values of set-aside tokens are not read)."""
    rc, out, err = cli("run", "-m", smollm2, "-f", doc, "-p", "Which line is first?", "--kv-cells", 512,
                       "--budget", 256, "--json", "--max-tokens", 4, *extra)
    assert rc == 0, err
    d = json.loads(out)
    assert d["logical_tokens"] > 512 >= d["kept_tokens"] and d["evictions"] >= 2 and d["eviction_s"] > 0
    assert (d["reselected_tokens"] > 0) == (extra in ([], ["--set", "lookahead=8"]))
    if extra == []:
        rc, _, err = cli("run", "-m", smollm2, "-f", doc, "-p", "Which?", "--set", "reselect=maybe")
        assert rc != 0 and "--set reselect: expected true or false, got 'maybe'" in err


def test_inspect_text_json_and_png(smollm2, doc, tmp_path):
    png = tmp_path / "heads.png"
    rc, out, err = cli("inspect", "-m", smollm2, "-f", doc, "--png", png)   # default cache: the prompt fits
    assert rc == 0, err
    rmap = [l for l in out.split("retained pages ('#' kept) per layer x KV head:\n")[1].splitlines()
            if l.startswith("  ")]
    assert len(rmap) == 90 and all(set(l.strip()) <= set("#+.") and "#" in l for l in rmap[:90])
    assert png.read_bytes()[:4] == b"\x89PNG" and f"figures written to {png}" in out
    rc, out, err = cli("inspect", "-m", smollm2, "-f", doc, "--json")
    d = json.loads(out)
    assert len(d["entropies"]) == 30 and len(d["weights"][0]) == 9 and len(d["sink_masses"]) == 30


def test_chat_with_save_load_and_stats(smollm2, tmp_path):
    sess = tmp_path / "s.entrokv"
    script = f"Hello!\n/stats\n/save {sess}\nWhat did I say?\n/load {sess}\n/stats\n/quit\n"
    rc, out, err = cli("chat", "-m", smollm2, "--kv-cells", 512, "--budget", 128, "--max-tokens", 8, stdin=script)
    assert rc == 0, err
    stats = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    assert len(stats) == 2 and stats[0] == stats[1]          # /load brought back the saved conversation
    assert f"saved {sess}" in out and "loaded" in out


def test_chat_recalls_at_a_later_turn_with_recall_turns_and_not_by_default(smollm2, doc):
    """A document that overflows the cache, then a question in a later turn: with --recall turns the store of
    evicted tokens is on (its rows in a temporary file) and the later turn recalls from it; by default, and with
    --no-recall, no store."""
    text = doc.read_text().replace("\n", " ")          # one chat message
    script = f"{text}\nWhich line is first?\n/stats\n/quit\n"
    for flag, on in ((("--recall", "turns"), True), ((), False), (("--no-recall",), False)):
        rc, out, err = cli("chat", "-m", smollm2, "--kv-cells", 512, "--budget", 128, "--max-tokens", 4, *flag,
                           stdin=script)
        assert rc == 0, err
        rep = [json.loads(l) for l in out.splitlines() if l.startswith("{")][-1]
        assert rep["evictions"] >= 1 and rep["recall"]["on"] is on
        if on:
            assert rep["recall"]["where"].startswith("file in ") and rep["recall"]["store_tokens_per_group"] > 0
            assert rep["recall"]["recalls"] >= 1


@pytest.mark.parametrize("case", ["missing model", "not gguf", "corrupt gguf", "empty prompt", "page size",
                                  "budget below protected", "budget above cache", "binary file", "unknown name",
                                  "unsupported architecture", "edge option on another policy", "edge pool even",
                                  "edge spread negative", "edge decay zero", "edge value power", "edge lookahead",
                                  "edge lookahead share", "unknown setting", "setting without value",
                                  "setting of the wrong type", "config not json", "config not an object",
                                  "config missing", "empty file", "non-UTF-8 file", "device file", "budget inf",
                                  "kv-cells above the context", "kv-cells beyond uint32", "threads above ggml",
                                  "threads zero", "temperature nan", "not an integer", "unknown option",
                                  "prompt longer than the context", "set budget nan", "config huge number",
                                  "config as a bool"])
def test_bad_input_is_one_clear_line(smollm2, doc, tmp_path, case):
    from synth import write_model
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("hello")
    corrupt = tmp_path / "c.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(64))
    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(256)))
    listfile = tmp_path / "list.json"
    listfile.write_text("[1, 2]")
    hugefile, boolfile = tmp_path / "huge.json", tmp_path / "bool.json"
    hugefile.write_text('{"pool": ' + "9" * 5000 + "}")
    boolfile.write_text('{"window": true}')
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e".encode("latin-1"))
    (tmp_path / "long.txt").write_text("the keeper wrote a ledger of every ship " * 1500)   # ~ 12k tokens > 8192
    args = {
        "missing model": ["-m", tmp_path / "nope.gguf", "-p", "hi"],
        "not gguf": ["-m", notgguf, "-p", "hi"],
        "corrupt gguf": ["-m", corrupt, "-p", "hi"],
        "empty prompt": ["-m", smollm2, "-p", "   "],
        "page size": ["-m", smollm2, "-f", doc, "--set", "page_size=0"],
        "budget below protected": ["-m", smollm2, "-f", doc, "--budget", 0.001],
        "budget above cache": ["-m", smollm2, "-f", doc, "--kv-cells", 512, "--budget", 0.9],
        "binary file": ["-m", smollm2, "-f", binary],
        "unknown name": ["-m", "no-such-model", "-p", "hi"],
        "edge option on another policy": ["-m", smollm2, "-f", doc, "--policy", "page-entrokv", "--set", "pool=7"],
        "edge pool even": ["-m", smollm2, "-f", doc, "--policy", "entrokv-edge", "--set", "pool=4"],
        "edge spread negative": ["-m", smollm2, "-f", doc, "--set", "spread=-2"],
        "edge decay zero": ["-m", smollm2, "-f", doc, "--set", "decay=0"],
        "edge value power": ["-m", smollm2, "-f", doc, "--set", "value_power=-1"],
        "edge lookahead": ["-m", smollm2, "-f", doc, "--set", "lookahead=65"],
        "edge lookahead share": ["-m", smollm2, "-f", doc, "--set", "lookahead_share=1.5"],
        "unknown setting": ["-m", smollm2, "-f", doc, "--set", "pages=4"],
        "setting without value": ["-m", smollm2, "-f", doc, "--set", "pool"],
        "setting of the wrong type": ["-m", smollm2, "-f", doc, "--set", "pool=wide"],
        "config not json": ["-m", smollm2, "-f", doc, "--config", doc],
        "config not an object": ["-m", smollm2, "-f", doc, "--config", listfile],
        "config missing": ["-m", smollm2, "-f", doc, "--config", tmp_path / "none.json"],
        "empty file": ["-m", smollm2, "-f", tmp_path / "empty.txt"],
        "non-UTF-8 file": ["-m", smollm2, "-f", tmp_path / "latin1.txt"],
        "device file": ["-m", smollm2, "-f", "/dev/zero"],
        "budget inf": ["-m", smollm2, "-f", doc, "--budget", "inf"],
        "kv-cells above the context": ["-m", smollm2, "-f", doc, "--kv-cells", 10**7],
        "kv-cells beyond uint32": ["-m", smollm2, "-f", doc, "--kv-cells", 2**32 + 1024],
        "threads above ggml": ["-m", smollm2, "-f", doc, "--threads", 100000],
        "threads zero": ["-m", smollm2, "-f", doc, "--threads", 0],
        "temperature nan": ["-m", smollm2, "-f", doc, "--temp", "nan"],
        "not an integer": ["-m", smollm2, "-f", doc, "--kv-cells", "3.5"],
        "unknown option": ["-m", smollm2, "-f", doc, "--bogus"],
        "prompt longer than the context": ["-m", smollm2, "-f", tmp_path / "long.txt"],
        "set budget nan": ["-m", smollm2, "-f", doc, "--set", "budget=nan"],
        "config huge number": ["-m", smollm2, "-f", doc, "--config", hugefile],
        "config as a bool": ["-m", smollm2, "-f", doc, "--config", boolfile],
        "unsupported architecture": ["-m", write_model(tmp_path / "vl.gguf", arch="qwen2vl", n_head=4, n_head_kv=2),
                                     "-p", "hello there, how are you doing today my friend", "--budget", 1.0],
    }[case]
    rc, out, err = cli("run", *args)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("entrokv-edge: ") and "Traceback" not in err, err
    want = {"edge option on another policy": "belong to the entrokv-edge policy", "edge pool even": "odd",
            "edge spread negative": "spread must be an integer >= 0",
            "edge decay zero": "decay must be a number in (0, 1]",
            "edge value power": "value_power must be a number in [0, 4]",
            "edge lookahead": "lookahead must be an integer in [0, 64]",
            "edge lookahead share": "lookahead_share must be a number in [0, 1]",
            "unknown setting": "KEY one of", "setting without value": "expected KEY=VALUE",
            "setting of the wrong type": "expected an integer", "config not json": "is not a JSON object",
            "config not an object": "must hold a JSON object", "config missing": "cannot read",
            "empty file": "the prompt is empty", "non-UTF-8 file": "not a UTF-8 text file",
            "device file": "larger than 16 MiB", "budget inf": "budget must be a fraction (0.2) or a token count",
            "kv-cells above the context": "more than the model's context (8192 tokens)",
            "kv-cells beyond uint32": "more than the model's context", "threads above ggml": "at most 512",
            "threads zero": "must be an integer >= 1", "temperature nan": "finite number",
            "not an integer": "expected an integer, got '3.5'", "unknown option": "unrecognized arguments: --bogus",
            "prompt longer than the context": "does not fit the model's context (8192 tokens)",
            "set budget nan": "--set budget: budget must be a fraction",
            "config huge number": "is not a JSON object of settings", "config as a bool": "window must be an integer"}.get(case)
    assert want is None or want in lines[0], lines[0]


def test_kv_cells_without_a_budget_keeps_what_the_cache_can_hold(smollm2, doc):
    """The headline use: a document longer than the cache, --kv-cells and no --budget. The budget is
    what the cache keeps with room for the answer (a quarter of it stays free), not a share of the
    prompt that might not fit; every eviction between pieces is steered by the prompt's end."""
    rc, out, err = cli("run", "-m", smollm2, "-f", doc, "-p", "Which line is first?", "--kv-cells", 512, "--json",
                       "--max-tokens", 4)
    assert rc == 0, err
    d = json.loads(out)
    cap = 512 - 512 // 4
    assert d["logical_tokens"] > 2 * 512 and d["evictions"] >= 2
    assert cap - EDGE_DEFAULTS["page_size"] < d["kept_tokens"] <= cap + 3     # + up to 3 tokens decoded after it
    assert d["guided_evictions"] == d["evictions"] - 1 and d["guide_s"] > 0     # all but the one after the prompt


def test_gemma3_through_a_cache_smaller_than_its_window_plus_a_ubatch(gemma3, doc):
    """Gemma 3's sliding-window layers keep their last 512 tokens plus a ubatch: the command picks
    a ubatch that fits beside them (768 cells: 256), so --kv-cells 768 reads a longer document in
    pieces; where not even the observed window fits beside them, one clear line names the size."""
    rc, out, err = cli("run", "-m", gemma3, "-f", doc, "-p", "Which line is first?", "--kv-cells", 768, "--json",
                       "--max-tokens", 4)
    assert rc == 0, err
    d = json.loads(out)
    assert d["kv_cells"] == 768 and d["logical_tokens"] > 768 and d["evictions"] >= 2
    rc, out, err = cli("run", "-m", gemma3, "-f", doc, "-p", "Which line is first?", "--kv-cells", 540,
                       "--max-tokens", 4)
    assert rc == 2 and "Traceback" not in err and "use --kv-cells 544 or more" in err


def test_help_fits_a_screen_and_names_the_common_flags():
    rc, out, _ = cli("run", "--help")
    assert rc == 0 and len(out.splitlines()) <= 45
    for flag in ("--model", "--file", "--prompt", "--kv-cells", "--budget", "--policy", "--max-tokens", "--temp",
                 "--threads", "--json", "--set", "--config"):
        assert flag in out
    assert "--pool" not in out and "--lookahead" not in out        # research settings: --set
    rc, out, _ = cli("--help")
    desc = out.split("\n\n")[1].replace("\n", " ")
    assert rc == 0 and desc.rstrip().endswith(".")


def test_a_chat_message_longer_than_the_context_is_refused_and_the_chat_goes_on(tmp_path):
    """llama-cpp-python refuses a conversation longer than the model's context with a ValueError:
    the chat prints one line for it and goes on (it was a traceback)."""
    from synth import write_model
    model = write_model(tmp_path / "short.gguf", n_ctx_train=256, seed=4)
    script = "hello\n" + "abc " * 400 + "\n/stats\n/quit\n"
    rc, out, err = cli("chat", "-m", model, "--kv-cells", 256, "--budget", 64, "--set", "page_size=8",
                       "--set", "window=16", "--max-tokens", 4, stdin=script)
    assert rc == 0 and "Traceback" not in err, err
    assert [l for l in err.splitlines() if l.startswith("entrokv-edge: not answered: ")], err
    stats = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    assert len(stats) == 1 and stats[0]["logical_tokens"] > 0
