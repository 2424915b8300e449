#!/usr/bin/env bash
# The GPU check of issues 18 and 36 (benchmarks/gpu_check.py): raymoe's bf16 Qwen3-MoE block forward+backward
# (TFLOP/s, % of the GPU's peak), one-rank training of a 2-layer Qwen3-30B-A3B slice against transformers
# (tokens/s, peak memory), NCCL chosen by the rank, and the readiness paths of issue 36 on tiny bf16 models
# (benchmarks/gpu_readiness.py: the default precision policy, sharded accumulation, CPU offload with bias
# balancing, async save_state / load_state, generate; host syncs counted under set_sync_debug_mode("warn")).
# It prints the torch / transformers / ray versions it ran on. Under 5 minutes on one H100/H200 at the defaults.
# Not part of `make test`. Arguments go to gpu_check.py (--smoke, --parts block train, --out FILE, ...).
#
#   bash benchmarks/gpu_check.sh --smoke                   # here, on CPU: tiny shapes, figures not meaningful
#   bash benchmarks/gpu_check.sh                           # on a machine with a GPU and every package
#
# With the device tool (nvidia-h200 machine, which starts bare: python3 3.12 with torch 2.11, transformers
# 5.17, safetensors, huggingface_hub, tokenizers, numpy, jinja2, tqdm, matplotlib, but NO ray and NO pydantic,
# and no registry to install them from; see /work/.library/device/KINDS.md):
#
#   1. Here, once per session (needs the network; writes .whl/ in the repo root, git-ignored through
#      .git/info/exclude):
#          bash benchmarks/gpu_check.sh --prepare-wheels
#      which downloads, for CPython 3.12 manylinux x86-64 (pip download --no-deps --only-binary=:all:):
#          ray==2.60.0  (repacked without ray/jars, ray/rllib and the dashboard's web client: the full wheel is
#                        79 MB, over the 64 MiB a call carries; ~45 MB after)
#          pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
#          typing_extensions==4.16.0 packaging==26.4
#          jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
#          transformers==5.23.0  (the tests' reference version; the image's is older; 13 MB, ~58 MiB in all)
#   2. One device call, carrying the wheels (this script installs them when ray or pydantic is missing, with
#      the README's line
#          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#              --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#      ), the JSON coming back from $OUT:
#          run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=480)
#      Leave gpu_check.json files out of the repo root: untracked files travel too.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEEL_DIR="${WHEEL_DIR:-$ROOT/.whl}"
WHEEL_PYTHON_VERSION="${WHEEL_PYTHON_VERSION:-3.12}"  # the device machine's python3

if [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi

WHEELS=(
    ray==2.60.0
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing_extensions==4.16.0 packaging==26.4
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    transformers==5.23.0
)

# Download the wheels the device machine lacks into $WHEEL_DIR and shrink ray's below the carry limit.
prepare_wheels() {
    mkdir -p "$WHEEL_DIR"
    if [[ "$WHEEL_DIR" == "$ROOT/.whl" ]] && ! grep -qxF '/.whl/' .git/info/exclude 2>/dev/null; then
        echo '/.whl/' >> .git/info/exclude
    fi
    local platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
        manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$WHEEL_PYTHON_VERSION" \
        --implementation cp "${platforms[@]}" -d "$WHEEL_DIR" "${WHEELS[@]}"
    python3 - "$WHEEL_DIR"/ray-*.whl <<'EOF'
"""Rewrite ray's wheel without what a Python driver with no dashboard never reads (RECORD updated)."""
import os, sys, zipfile

DROP = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/build/")
for path in sys.argv[1:]:
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(DROP):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(DROP)).encode()
            dst.writestr(info, data)  # the ZipInfo keeps permissions (raylet, gcs_server are executables)
    os.replace(tmp, path)
    print(f"{os.path.basename(path)}: {os.path.getsize(path) / 2**20:.1f} MiB after dropping {', '.join(DROP)}")
EOF
    du -sh "$WHEEL_DIR"
}

if [[ "${1:-}" == "--prepare-wheels" ]]; then
    prepare_wheels
    exit 0
fi

# A bare device machine: install the carried wheels (README's line) when ray or pydantic is missing.
if ! "$PY" -c 'import ray, pydantic' 2>/dev/null && compgen -G "$WHEEL_DIR/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEEL_DIR"/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# raymoe and actors from this checkout, also in Ray's worker processes (they inherit the environment).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"
