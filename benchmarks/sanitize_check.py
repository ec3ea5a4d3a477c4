"""A deliberate heap overflow through our C API, for benchmarks/sanitize.sh: a true-position
table 8 values short of n_slots * kv_size, with its full size claimed. Under the sanitizers the
write must be reported (the process aborts); anywhere else it is a bug to run this."""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numpy as np  # noqa: E402

import entrokv_edge as ek  # noqa: E402
from entrokv_edge.bindings.native import c_api, context_pointer  # noqa: E402
from llama_cpp import Llama  # noqa: E402
from synth import write_model  # noqa: E402

llm = Llama(str(write_model(Path(tempfile.mkdtemp()) / "m.gguf")), n_ctx=64, n_threads=1, verbose=False)
llm.eval([5, 6, 7])
g = ek.geometry(llm)
ffi, lib = c_api()
short = np.empty(g.n_slots * g.kv_size - 8, np.int32)
lib.llama_entrokv_true_pos(context_pointer(llm), ffi.from_buffer("int32_t[]", short), g.n_slots * g.kv_size)
print("the overflow went unreported")
