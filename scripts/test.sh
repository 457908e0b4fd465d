#!/usr/bin/env bash
# Sets up jaxdnn with its test dependencies and runs the test suite (on the GPU if there is one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# -P: import the installed jaxdnn, not the source folder of the same name.
status=0
.venv/bin/python -P -m pytest tests -q -p no:cacheprovider "$@" || status=$?
# pytest exits 5 when it collected no test: a suite that ran nothing has not passed.
if [ "$status" -eq 5 ]; then echo "test.sh: pytest collected no tests" >&2; exit 1; fi
exit "$status"
