"""Scoring and compaction with the KV cache on llama.cpp's RPC backend (loopback).

The server is `entrokv-edge rpc-server` in a subprocess on 127.0.0.1; the client work
runs in another subprocess (tests/rpc_client.py), because ggml aborts a process whose
registered server goes away. Both are stopped by the fixtures, with bounded waits.

Needs a -DGGML_RPC=ON build; with the default build the RPC tests skip (they fail
instead when ENTROKV_REQUIRE_RPC=1, as in CI's RPC run).
"""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from entrokv_edge.runtime import rpc

HERE = Path(__file__).parent
REQUIRED = os.environ.get("ENTROKV_REQUIRE_RPC") == "1"
needs_rpc = pytest.mark.skipif(not rpc.supported() and not REQUIRED,
                               reason="built without -DGGML_RPC=ON (see README, GPU and multi-host use)")
# the server runs the same CPU kernels, so results match bit for bit here; the bounds
# below are what a different server CPU (other SIMD paths) may legitimately change
SCORE_TOL = 1e-6
LOGIT_TOL = 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def rpc_server():
    assert rpc.supported(), "ENTROKV_REQUIRE_RPC=1 but this build has no RPC backend"
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "entrokv_edge", "rpc-server", "--host", "127.0.0.1",
                             "--port", str(port), "--threads", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"rpc-server exited with {proc.returncode}: {proc.stdout.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("rpc-server did not listen within 30 s")
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def rpc_results(rpc_server, smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("rpc") / "results.npz"
    proc = subprocess.Popen([sys.executable, str(HERE / "rpc_client.py"), rpc_server, str(smollm2), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        text, _ = proc.communicate(timeout=400)
    finally:
        _stop(proc)
    assert proc.returncode == 0, f"rpc client failed ({proc.returncode}):\n{text.decode()[-3000:]}"
    return dict(np.load(out))


@needs_rpc
def test_the_server_offers_a_device(rpc_results):
    assert list(rpc_results["devices"]) == ["RPC0"]


@needs_rpc
@pytest.mark.parametrize("cache", ["f32", "f16fa"])
@pytest.mark.parametrize("placement", ["rpc", "split"])
def test_scores_on_rpc_equal_the_cpu_run(rpc_results, cache, placement):
    ref = rpc_results[f"{cache}/cpu/scores"]
    got = rpc_results[f"{cache}/{placement}/scores"]
    assert got.shape == ref.shape and ref.shape[0] == 30
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-4)   # each head's attention sums to 1
    assert np.abs(got - ref).max() <= SCORE_TOL


@needs_rpc
@pytest.mark.parametrize("cache", ["f32", "f16fa"])
@pytest.mark.parametrize("placement", ["rpc", "split"])
def test_compaction_on_rpc_gives_the_cpu_logits(rpc_results, cache, placement):
    """Per-head random keeps, moved by the ggml graph path on the RPC buffers (all layers,
    or the last half beside host layers), against the host path on the CPU."""
    ref = rpc_results[f"{cache}/cpu/logits"]
    got = rpc_results[f"{cache}/{placement}/logits"]
    assert np.abs(got - ref).max() <= LOGIT_TOL
    assert int(np.argmax(got)) == int(np.argmax(ref))


@needs_rpc
@pytest.mark.parametrize("cache", ["f32", "f16fa"])
@pytest.mark.parametrize("placement", ["rpc", "split"])
def test_value_norms_read_from_rpc_equal_the_cpu_run(rpc_results, cache, placement):
    """llama_entrokv_value_norms on V held by the RPC server (transposed F32, or F16 rows),
    after the per-head compaction: the CPU run's norms, cell by cell; 0 past the kept cells."""
    ref = rpc_results[f"{cache}/cpu/norms"]
    got = rpc_results[f"{cache}/{placement}/norms"]
    K = int((ref > 0).sum(axis=1)[0])
    assert got.shape == ref.shape and K > 0 and (ref[:, :K] > 0).all() and not ref[:, K:].any()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@needs_rpc
@pytest.mark.parametrize("cache", ["f32", "f16fa"])
@pytest.mark.parametrize("placement", ["rpc", "split"])
def test_rows_read_from_and_written_to_rpc_equal_the_cpu_run(rpc_results, cache, placement):
    """llama_entrokv_read_cells / _write_cells on the RPC buffers (ggml_backend_tensor_get/set): the
    rows of 16 cells per slot equal the CPU run's; written back exchanged (8 cells for 8), the table
    and the next logits (above, test_compaction_...) are the CPU run's too."""
    for part in ("rows_k", "rows_v"):
        ref, got = rpc_results[f"{cache}/cpu/{part}"], rpc_results[f"{cache}/{placement}/{part}"]
        assert got.shape == ref.shape and np.abs(ref).max() > 0
        np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4)
    tp_ref, tp = rpc_results[f"{cache}/cpu/true_pos_written"], rpc_results[f"{cache}/{placement}/true_pos_written"]
    assert np.array_equal(tp, tp_ref)
    assert (tp[:, 8:16] > tp[:, 16:24]).all()       # the exchange happened: ascending lists now descend there


@needs_rpc
def test_long_prompt_through_a_small_cache_split_over_rpc(rpc_results):
    assert int(rpc_results["long/cpu/n_prompt"]) > 3 * 256          # three caches' worth of prompt
    assert int(rpc_results["long/split/evictions"]) >= 3
    assert int(rpc_results["long/split/evictions"]) == int(rpc_results["long/cpu/evictions"])
    assert list(rpc_results["long/split/tokens"]) == list(rpc_results["long/cpu/tokens"])


# --- errors: these run in every build --------------------------------------------------

@pytest.mark.parametrize("bad", ["localhost", "127.0.0.1:", ":50052", "127.0.0.1:0", "127.0.0.1:99999", "::1:50052"])
def test_bad_endpoints_are_refused(bad):
    with pytest.raises(ValueError, match="host:port"):
        rpc.parse_endpoint(bad)


def test_add_servers_refuses_an_unreachable_server_without_aborting():
    if not rpc.supported():
        with pytest.raises(rpc.RPCUnavailableError, match="GGML_RPC=ON"):
            rpc.add_servers(f"127.0.0.1:{_free_port()}")
        return
    with pytest.raises(rpc.RPCUnavailableError, match="cannot be reached"):
        rpc.add_servers(f"127.0.0.1:{_free_port()}", timeout=1)


@needs_rpc
def test_rpc_server_on_a_busy_port_is_a_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "entrokv_edge", "rpc-server", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.startswith("entrokv-edge: cannot serve on 127.0.0.1:") and p.stderr.count("\n") == 1
