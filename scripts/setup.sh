#!/usr/bin/env bash
# Installs everything gradzip needs on a fresh machine: a CPU build of torch (pinned: an unpinned torch
# pulls several GB of CUDA wheels), the package with its test extras and the pinned Lightning,
# Accelerate and Transformers of tests/stacks (one pip command with the pinned torch, so pip cannot
# replace that torch), and the Fashion-MNIST files (Debian's dataset-fashion-mnist) when running as
# root.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "note: Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist, as root); tests that need it are skipped" >&2
  fi
fi
python3 -m pip install -q --disable-pip-version-check "torch==${GRADZIP_TORCH_VERSION:-2.13.0}" -e ".[test,stacks]"
