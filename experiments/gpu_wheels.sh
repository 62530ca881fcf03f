#!/usr/bin/env bash
# The wheels the device check needs on a GPU machine with no network (python 3.12, x86-64), into .whl/ (ignored by
# git): reasoning-gym 0.1.25 (--task arithmetic) and what it needs beyond a torch + transformers environment, and
# TRL 1.16.0 with the datasets library (experiments/gpu_check.py's trl phase). experiments/gpu_check.py --wheels .whl
# installs them there (pip resolves reasoning-gym against what is installed; TRL and datasets go in with --no-deps).
#
# Left out, because the card's Python has them whenever it runs transformers and torch (their own requirements):
# numpy (transformers), sympy, mpmath (torch). Their 23 MB made the
# tree too large to travel with results/ (59 MB of wheels + 14 MB of tree > 64 MiB; the fifth to seventh runs moved
# results/ aside). Kept although the card's image lists them, as the earlier runs carried them: matplotlib and its
# compiled dependencies (cellpylib imports matplotlib.pyplot when reasoning-gym loads); pyyaml (reasoning-gym asks
# for >= 6.0.2, transformers for >= 5.1). pycosat is a source archive (no wheel on PyPI; the card has a compiler: it
# built there), with setuptools, wheel and packaging to build it (pip's isolated build finds them in .whl only).
# Prints the folder's size and the tree's: both together must stay under the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl /tmp/gpu_wheels_src
PLAT="--python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all:"
pip download -q --no-deps -d .whl $PLAT matplotlib==3.11.2 pillow==13.0.0 fonttools==4.68.0 contourpy==1.3.3 \
    kiwisolver==1.5.1 xxhash==4.1.0 pyyaml==6.0.4
pip download -q -d /tmp/gpu_wheels_src reasoning-gym==0.1.25            # the pure-Python rest, and three sources
for f in /tmp/gpu_wheels_src/*-none-any.whl; do
    case "$(basename "$f")" in numpy-*|sympy-*|mpmath-*) ;; *) cp "$f" .whl/ ;; esac
done
cp /tmp/gpu_wheels_src/pycosat-*.tar.gz .whl/
pip wheel -q --no-deps --no-build-isolation -w .whl /tmp/gpu_wheels_src/cellpylib-*.tar.gz /tmp/gpu_wheels_src/zss-*.tar.gz
pip download -q --no-deps -d .whl setuptools wheel                       # to build pycosat there
pip download -q --no-deps -d .whl $PLAT trl==1.16.0 datasets==4.8.4 dill==0.4.1 multiprocess==0.70.19
du -sh .whl
echo "tree that travels (tracked + untracked, not ignored) and .whl, MB:"
{ git ls-files -z; git ls-files -z --others --exclude-standard; } | du -cb --files0-from=- 2>/dev/null | tail -1 \
    | awk -v w="$(du -sb .whl | cut -f1)" '{printf "  tree %.1f + wheels %.1f = %.1f (limit 67.1)\n", $1/1e6, w/1e6, ($1+w)/1e6}'
