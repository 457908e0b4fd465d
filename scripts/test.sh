#!/usr/bin/env bash
# Sets up jaxdnn with its test dependencies and runs the test suite (on the GPU if there is one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# -P: import the installed jaxdnn, not the source folder of the same name.
exec .venv/bin/python -P -m pytest tests -q -p no:cacheprovider "$@"
