#!/usr/bin/env bash
# Does `pip install -e .` keep a torch that is already installed and in the declared range? A fresh venv gets a
# metadata-only stand-in distribution "torch" of version TORCH (default 2.11.0, the lowest in range; no download of a
# multi-GB CUDA build), then pip resolves `pip install -e .` as a dry run. Exit 0 when pip would not touch torch.
#
#   bench/keeps_torch.sh [TORCH_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-2.11.0}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/stub"
printf 'from setuptools import setup\nsetup(name="torch", version="%s", packages=[])\n' "$version" >"$tmp/stub/setup.py"
python3 -m venv "$tmp/venv"
. "$tmp/venv/bin/activate"
pip install -q setuptools wheel
pip wheel -q --no-deps --no-build-isolation -w "$tmp/dist" "$tmp/stub"
pip install -q --no-deps "$tmp"/dist/torch-*.whl
pip install --dry-run -e . >"$tmp/dry.log" 2>&1 || { cat "$tmp/dry.log" >&2; exit 1; }
would="$(grep '^Would install' "$tmp/dry.log" || true)"
echo "$would"
if tr ' ' '\n' <<<"$would" | grep -q '^torch-'; then
  echo "bench/keeps_torch.sh: pip would replace torch $version" >&2
  exit 1
fi
echo "torch $version kept"
