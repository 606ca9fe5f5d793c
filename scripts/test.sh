#!/usr/bin/env bash
# Set up (scripts/setup.sh: .venv created and installed if needed) and run the README's test command,
# `python -m pytest tests`; arguments replace `tests` and go to pytest as they are, e.g. `scripts/test.sh tests/unit -x`,
# `scripts/test.sh -m bench` (without a path pytest runs pyproject's testpaths, `tests`).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
setup_venv
if [[ $# -eq 0 ]]; then
    set -- tests
fi
exec python -m pytest "$@"
