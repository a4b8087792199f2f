#!/usr/bin/env bash
# Installs everything gradzip needs on a fresh machine: a CPU build of torch (pinned: an unpinned torch
# pulls several GB of CUDA wheels), the package with its test extras and the pinned Lightning,
# Accelerate and Transformers of tests/stacks (one pip command with the pinned torch, so pip cannot
# replace that torch), and, when running as root, the datasets Debian packages: Fashion-MNIST
# (dataset-fashion-mnist) and the Python documentation's sources, the `corpus` text dataset (python3-doc,
# about 13 MB to download).
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
[ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || missing+=(dataset-fashion-mnist)
compgen -G "/usr/share/doc/python3.*/html/_sources" >/dev/null || missing+=(python3-doc)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "note: ${missing[*]} not installed (apt-get install ${missing[*]}, as root); tests that need them are skipped" >&2
  fi
fi
python3 -m pip install -q --disable-pip-version-check "torch==${GRADZIP_TORCH_VERSION:-2.13.0}" -e ".[test,stacks]"
