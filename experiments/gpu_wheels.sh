#!/usr/bin/env bash
# The wheels the device check needs on a GPU machine with no network (python 3.12, x86-64; measured on the
# project's H200: its venv has torch and transformers but no numpy, and the `pip` on its PATH belongs to another
# interpreter). Writes them to .whl/ (ignored by git; ~59 MB, so with results/ the tree passes the 64 MiB a call
# may carry: move results/ aside for that call). On the GPU machine:
#   python -m pip install --no-index --find-links .whl reasoning-gym==0.1.25 && python experiments/gpu_check.py ...
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl /tmp/gpu_wheels_src
PLAT="--python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all:"
pip download -q --no-deps -d .whl $PLAT numpy==2.4.6 matplotlib==3.11.2 pillow==13.0.0 fonttools==4.68.0 \
    contourpy==1.3.3 kiwisolver==1.5.1 pyyaml==6.0.4
pip download -q -d /tmp/gpu_wheels_src reasoning-gym==0.1.25            # the pure-Python rest, and three sources
cp /tmp/gpu_wheels_src/*-none-any.whl /tmp/gpu_wheels_src/pycosat-*.tar.gz .whl/
pip wheel -q --no-deps --no-build-isolation -w .whl /tmp/gpu_wheels_src/cellpylib-*.tar.gz /tmp/gpu_wheels_src/zss-*.tar.gz
pip download -q --no-deps -d .whl setuptools wheel                         # to build pycosat there (it has a compiler)
du -sh .whl
