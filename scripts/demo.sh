#!/usr/bin/env bash
# Set up (scripts/setup.sh: .venv created and installed if needed) and run `shardtune demo`; extra arguments are
# passed to it, e.g. `scripts/demo.sh --help`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
setup_venv
exec shardtune demo "$@"
