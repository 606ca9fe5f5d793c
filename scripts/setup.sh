# Sourced by scripts/demo.sh and scripts/test.sh: make sure the virtualenv exists and holds this checkout
# installed as the README says (`pip install -c constraints/ci.txt -e ".[dev,report]"`: the exact versions CI
# tests), then activate it. Idempotent: an installed venv is reused; pip runs again only when pyproject.toml or
# constraints/ci.txt is newer than the venv's stamp file. VENV (default .venv) and PYTHON (default python3)
# override the folder and the interpreter that creates it.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.shardtune-installed"

setup_venv() {
    cd "$ROOT"
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "setup: creating $VENV" >&2
        "${PYTHON:-python3}" -m venv "$VENV"
    elif [[ ! -e "$STAMP" ]] && "$VENV/bin/python" -c "import shardtune, pytest" 2>/dev/null; then
        # A venv installed before these scripts (by hand, as the README used to say): adopted as it is.
        echo "setup: reusing $VENV (delete $STAMP to reinstall)" >&2
        touch "$STAMP"
    fi
    if [[ ! -e "$STAMP" || pyproject.toml -nt "$STAMP" || constraints/ci.txt -nt "$STAMP" ]]; then
        echo "setup: installing shardtune into $VENV (pip install -c constraints/ci.txt -e \".[dev,report]\")" >&2
        "$VENV/bin/python" -m pip install -q -c constraints/ci.txt -e ".[dev,report]"
        touch "$STAMP"
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
}
