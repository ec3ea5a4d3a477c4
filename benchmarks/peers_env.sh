#!/usr/bin/env bash
# Builds .venv-peers (repo root, gitignored) for benchmarks/peers.py: the peer KV-eviction systems
# OpenVINO GenAI and kvpress, on CPU. Kept apart from the project's own venv on purpose.
#
#     bash benchmarks/peers_env.sh            # create or repair; skips when it already imports
#     PEERS_VENV=/elsewhere bash benchmarks/peers_env.sh
#
# torch is installed first and alone, pinned to the CPU build, so that no later resolver step can
# pull a CUDA torch (several GB). Every package is pinned exactly (the full resolved set below).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PEERS_VENV:-$ROOT/.venv-peers}"
PY="$VENV/bin/python"
T0=$(date +%s)

TORCH="torch==2.13.0+cpu"
# The direct requirements of benchmarks/peers.py ...
TOP=(
  "transformers==5.2.0"          # < 5.3 for kvpress 0.5.5; loads (dequantizes) GGUF with `gguf`
  "gguf==0.19.0"
  "kvpress==0.5.5"
  "openvino==2026.4.1"
  "openvino-genai==2026.4.1.0"
  "openvino-tokenizers==2026.4.1.0"
  "numpy==2.4.6"
)
# ... and everything they resolved to (pip freeze of a working env), pinned too.
LOCK=(
  accelerate==1.15.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 cachetools==5.5.2
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 datasets==5.2.0 dill==0.4.1
  filelock==4.3.1 fire==0.6.0 fsspec==2026.9.0 h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9
  httpx==0.28.1 huggingface_hub==1.33.0 idna==3.20 Jinja2==3.1.6 markdown-it-py==4.3.0
  MarkupSafe==3.0.4 mdurl==0.1.2 mpmath==1.3.0 multiprocess==0.70.19 networkx==3.6.1
  openvino-telemetry==2025.2.0 packaging==26.4 pandas==2.3.3 peft==0.21.2 psutil==7.2.2
  pyarrow==26.0.1 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 python-dateutil==4.0.0
  pytz==2026.6 PyYAML==6.0.4 regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0
  shellingham==1.5.4 six==1.17.0 sympy==1.14.0 termcolor==3.3.0 tokenizers==0.22.2 tqdm==4.70.1
  typer==0.29.2 typer-slim==0.24.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  tzdata==2026.6 urllib3==2.8.0 xxhash==4.1.0
)

check() {
  "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
want = {"torch": "2.13.0", "transformers": "5.2.0", "kvpress": "0.5.5", "gguf": "0.19.0",
        "openvino": "2026.4.1", "openvino-genai": "2026.4.1.0", "openvino-tokenizers": "2026.4.1.0"}
for name, ver in want.items():
    have = md.version(name)
    if have.split("+")[0] != ver:
        sys.exit(f"{name} {have} != {ver}")
import torch, transformers, kvpress, openvino_genai, openvino_tokenizers  # noqa: F401
assert "+cpu" in torch.__version__ or not torch.cuda.is_available()
EOF
}

if [ -x "$PY" ] && check; then
  echo "peers env: $VENV already complete; nothing to do ($(( $(date +%s) - T0 )) s)"
  exit 0
fi

[ -x "$PY" ] || nice -n 10 python3 -m venv "$VENV"
PIP=("$PY" -m pip install --disable-pip-version-check -q)
# 1) torch alone. The "+cpu" local version matches only the CPU wheel (on local disk here, pip's
#    find-links); PyPI's plain 2.13.0 is the CUDA build, several GB, and can never satisfy it.
nice -n 10 "${PIP[@]}" "$TORCH" 2>&1 | grep -v "is ignored: it is neither" || true
if ! "$PY" -W ignore -c "import torch,sys; v=torch.__version__; print('torch', v); sys.exit(0 if v == '2.13.0+cpu' else 1)"; then
  echo "peers env: no CPU wheel for $TORCH reachable (pip find-links); not fetching a CUDA build" >&2
  exit 1
fi
# 2) the rest, torch held at what is installed (a constraint so nothing can swap it).
CONS="$(mktemp)"; trap 'rm -f "$CONS"' EXIT
"$PY" -W ignore -c "import torch; print('torch==' + torch.__version__)" > "$CONS"
nice -n 10 "${PIP[@]}" -c "$CONS" "${TOP[@]}" "${LOCK[@]}" 2>&1 | grep -v "is ignored: it is neither" || true
if ! check; then
  echo "peers env: install finished but the version check failed:" >&2
  "$PY" -m pip list 2>/dev/null | grep -i -E "torch|transformers|kvpress|openvino|gguf" >&2
  exit 1
fi
echo "peers env: $VENV ready in $(( $(date +%s) - T0 )) s"
