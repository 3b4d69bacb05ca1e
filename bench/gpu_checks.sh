#!/usr/bin/env bash
# The GPU checks as one script, for a lent CUDA machine: the CUDA tests, then the GPU capture
# benchmark's eager rows, then its compiled (CUDA-graph) rows, each under its own time limit so
# that one stage running long cannot cost the others. Logs go to $OUT (or ./gpu-out).
#
#   bash bench/gpu_checks.sh [WHEEL_DIR]      # from the checkout's root
#
# WHEEL_DIR: wheels of DMI's dependencies missing on that machine (zstandard, xxhash, ...),
# installed with --no-deps first. Without chDB there the benchmark runs with --no-catalog.
# For the lent H200 (Python 3.12, no network) they were fetched here, into an ignored folder
# carried with the run (stop 38):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl zstandard xxhash
# Warnings are shown, not raised (-W default): that machine's torch and transformers are
# other versions than CI's, and their deprecations are not what these checks are for.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ -n "${1:-}" ]; then
  $py -m pip install -q --no-index --no-deps --no-cache-dir "$1"/*.whl 2>&1 | tail -3
fi
$py -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . 2>&1 | tail -3
cat_flag=--no-catalog
$py -c "import chdb" 2>/dev/null && cat_flag=
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import torch, transformers, sys, os; from dmi.storage import _native; print('torch', torch.__version__, 'transformers', transformers.__version__, 'python', sys.version.split()[0], 'cpus', os.cpu_count(), 'native', _native.ACTIVE)"
  df -h /tmp | tail -1; } 2>&1 | tee "$out/machine.txt"
stages=" ${STAGES:-tests eager compiled} "  # which stages run, e.g. STAGES=eager
if [[ $stages == *" tests "* ]]; then
  timeout "${TEST_S:-150}" $py -m pytest -q -p no:cacheprovider -W default tests/test_capture_gpu.py \
    --durations=8 2>&1 | tee "$out/tests.log" | tail -40
fi
if [[ $stages == *" eager "* ]]; then
  timeout "${EAGER_S:-220}" $py bench/bench_capture_gpu.py $cat_flag --rounds "${ROUNDS:-3}" > "$out/eager.log" 2>&1
  echo "eager bench rc $?"; tail -25 "$out/eager.log"
fi
if [[ $stages == *" compiled "* ]]; then
  timeout "${COMPILED_S:-170}" $py bench/bench_capture_gpu.py --compiled $cat_flag --rounds "${ROUNDS:-3}" > "$out/compiled.log" 2>&1
  echo "compiled bench rc $?"; tail -25 "$out/compiled.log"
fi
