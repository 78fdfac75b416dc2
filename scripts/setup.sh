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
  echo "setup: installing the project and its dependencies into .venv (a few minutes the first time)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
