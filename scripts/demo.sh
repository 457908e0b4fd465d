#!/usr/bin/env bash
# Sets up jaxdnn and runs the demo (on the GPU if there is one, else on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
# -P: import the installed jaxdnn, not the source folder of the same name.
exec .venv/bin/python -P -m jaxdnn.demo "$@"
