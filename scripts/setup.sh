#!/usr/bin/env bash
# Idempotent set-up: .venv/ with the project installed (the `fedapp` command lands in
# .venv/bin/), and, where the machine allows it (Debian, root), Fashion-MNIST from Debian's
# dataset-fashion-mnist package. Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
FMNIST_DIR=/usr/share/datasets/fashion-mnist

if [ ! -f "$FMNIST_DIR/train-images-idx3-ubyte.gz" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Fashion-MNIST (Debian package dataset-fashion-mnist)"
    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "setup: Fashion-MNIST not found in $FMNIST_DIR; as root run" \
         "'apt-get install dataset-fashion-mnist', or pass --set data-dir=... (see docs/data.md)."
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi

# Reinstall only when the dependency list changed (the stamp holds pyproject's hash).
stamp=.venv/.fedapp-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x .venv/bin/fedapp ]; then
  # PyTorch's build for Linux brings CUDA's libraries: .venv takes about 6.3 GiB. Say so up
  # front rather than let pip fail half-way with "No space left on device".
  need_kib=$((6800 * 1024))
  have_kib=$(df -Pk . 2>/dev/null | awk 'NR == 2 {print $4}') || have_kib=""
  if [ -n "$have_kib" ] && [ "$have_kib" -lt "$need_kib" ] && [ ! -f "$stamp" ]; then
    echo "setup: .venv needs about 6.6 GiB free on $(df -P . | awk 'NR == 2 {print $6}')" \
         "(PyTorch with CUDA's libraries); only $((have_kib / 1024)) MiB are free." >&2
    exit 1
  fi
  echo "setup: installing the project and its dependencies into .venv (a few minutes the first time)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
