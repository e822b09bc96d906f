#!/usr/bin/env bash
# Creates .venv if needed, installs quantkit with its test oracles, runs the whole test suite on every core
# (pytest-xdist, scheduled by tests/conftest.py; one persistent JAX compilation cache shared by the workers).
# torch==2.13.0 is installed first so that pip takes the local CPU build, not a multi-GB CUDA one.
# Extra arguments go to pytest; --exhaustive also runs the full matrices behind the representative CI cases.
# --tpu: the TPU lane instead (tests marked `tpu`: tests/test_tpu.py), on a machine with a TPU, in one process (one
# program at a time can hold the chip), with the python3 there: its jax and libtpu, the other dependencies
# installed from wheels (README, "The TPU lane"); no virtual environment, no network.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--tpu" ]; then
  shift
  export JAX_PLATFORMS=tpu,cpu
  exec python3 -m pytest -q -p no:xdist -p no:cacheprovider -m tpu -rs "$@" tests/test_tpu.py
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
exec .venv/bin/python -m pytest -q -n auto "$@"
