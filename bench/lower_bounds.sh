#!/usr/bin/env bash
# Test the lower ends of the ranges pyproject.toml declares: a fresh venv with every dependency at its lowest
# declared version (`>=X` becomes `==X`), shardtune installed into it, then a subset of the tests.
#
#   bench/lower_bounds.sh [--venv DIR] [--torch SPEC] [--torch-index URL] [-- pytest arguments]
#
# --torch SPEC        install this torch instead of the lowest declared one (e.g. torch==2.13.0 where the
#                     lowest release is a multi-GB CUDA build you do not want on a CPU machine)
# --torch-index URL   install torch from this index (e.g. PyTorch's CPU wheel index) instead of PyPI
# --venv DIR          where to build the venv (default .venv-lowest)
# Default tests: config, data, fastpath, quant, hub, targets, merge, 2-rank parity and the adapter reload (minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-lowest torch_spec="" torch_index=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --torch) torch_spec="$2"; shift 2 ;;
    --torch-index) torch_index="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "bench/lower_bounds.sh: unknown argument $1 (see the header of this script)" >&2; exit 2 ;;
  esac
done
tests=("$@")
# test_targets and test_merge reach what sets peft's floor (peft.utils.transformers_weight_conversion, the
# is_lora_variant metadata the merge refuses variants by): a floor too low fails there, not in the others.
[[ ${#tests[@]} -gt 0 ]] || tests=(tests/unit/test_config.py tests/unit/test_data.py tests/unit/test_fastpath.py
  tests/unit/test_quant.py tests/unit/test_hub.py tests/unit/test_targets.py tests/unit/test_merge.py
  tests/distributed/test_parity.py tests/e2e/test_reload.py -q)

python3 -m venv "$venv"
. "$venv/bin/activate"
pins="$venv/lowest.txt"
# The lowest version of every tested range (a requirement with both bounds) among the dependencies and the dev
# and qlora extras (what the tests need); open-ended floors (pyyaml>=6) are left to the resolver.
python - "$pins" "$torch_spec" <<'EOF'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["dev"] + project["optional-dependencies"]["qlora"]
pins = {}
for req in reqs:
    m = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)\s*,\s*<", req)
    if m:
        pins[m.group(1).lower()] = m.group(2)
if sys.argv[2]:
    pins.pop("torch")  # installed by the caller's --torch
open(sys.argv[1], "w").write("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
EOF
echo "lowest versions:"; sed 's/^/  /' "$pins"
if [[ -n "$torch_spec" || -n "$torch_index" ]]; then
  spec="${torch_spec:-torch==$(python -c 'import re,tomllib;print(re.search(r">=([^,]+)",[d for d in tomllib.load(open("pyproject.toml","rb"))["project"]["dependencies"] if d.startswith("torch")][0]).group(1))')}"
  pip install -q ${torch_index:+--index-url "$torch_index"} "$spec"
fi
pip install -q -c "$pins" -e ".[dev,qlora]"
pip list 2>/dev/null | grep -i -E "^(torch|transformers|peft|accelerate|bitsandbytes|datasets|safetensors|huggingface.hub|tokenizers) "
PYTHONPATH="$PWD/src" python -m pytest "${tests[@]}"
