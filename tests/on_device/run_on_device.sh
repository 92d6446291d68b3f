#!/usr/bin/env bash
# The GPU checks of this repository, in one run on a machine with a CUDA device.
#
#   bash tests/on_device/run_on_device.sh OUT_DIR [suite_seconds]
#
# Uses the machine's own python3 with torch (CUDA build); the three packages are put on
# PYTHONPATH from packages/*/src, and optree is installed from .whl/ when it is missing there.
# Writes to OUT_DIR: on_device.log (tests/on_device: parity, compile, ZeRO/averagers on CUDA),
# gpu_marked.log (the rest of the suite's gpu-marked tests), gpu_step.md (benchmarks/gpu_step.py),
# compile.tsv (compile times) and suite.log (the whole suite with CUDA visible, pytest-xdist).
set -uo pipefail
out="${1:?usage: run_on_device.sh OUT_DIR [suite_seconds]}"
suite_s="${2:-240}"
mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 FO_REPORT_DIR="$out"
if ! python3 -c "import optree" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
src="$PWD/packages/functional_optim/src:$PWD/packages/dist_runtime/src:$PWD/packages/compat_api/src"
export PYTHONPATH="$src:$PWD:${PYTHONPATH:-}"
{
  nvidia-smi -L
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
} | tee "$out/device.txt"
pytest=(python3 -m pytest -p no:cacheprovider -q -rfE)
timeout 200 "${pytest[@]}" tests/on_device 2>&1 | tee "$out/on_device.log" | tail -25
timeout 90 "${pytest[@]}" tests -m gpu --ignore=tests/on_device 2>&1 \
  | tee "$out/gpu_marked.log" | tail -8
timeout 150 python3 benchmarks/gpu_step.py 2>&1 | tee "$out/gpu_step.md" | tail -45
timeout "$suite_s" "${pytest[@]}" tests --ignore=tests/on_device -p no:benchmark -n 14 --dist loadfile \
  2>&1 | tee "$out/suite.log" | tail -40
