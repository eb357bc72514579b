#!/usr/bin/env bash
# On the GPU machine: run one command in the working tree and in the baseline staged by
# scripts/stage_baseline.sh, in the order new, base, base, new (a drift in the machine
# shows as a difference between the two runs of one side). The command sees $TAG (new1,
# base1, base2, new2) to name its outputs, and runs from the tree it measures.
#
#   scripts/gpu_ab_baseline.sh 'python3 -m shared.harness.cli ab ... --output-dir $OUT/ab_$TAG'
#
# Installs the carried wheels (.whl/) as scripts/gpu_check.sh does.
set -uo pipefail
cmd="${1:?usage: scripts/gpu_ab_baseline.sh COMMAND}"
[ -f .baseline/commit ] || { echo "no .baseline/: run scripts/stage_baseline.sh BASE and carry .baseline" >&2; exit 2; }
OUT="${OUT:-$(pwd)/out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
new=$(pwd) base=/tmp/runnerlab-baseline
rm -rf "$base" && mkdir -p "$base"
tar --exclude=./.baseline --exclude=./.whl --exclude=./.venv --exclude=./.git -cf - . | tar -xf - -C "$base"
cp -r .baseline/files/. "$base/"
while read -r f; do [ -n "$f" ] && rm -f "$base/$f"; done < .baseline/added.txt
echo "baseline $(cat .baseline/commit) in $base" | tee "$OUT/ab_baseline.txt"
status=0
for run in new1 base1 base2 new2; do
  tree=$new; [ "${run#base}" != "$run" ] && tree=$base
  (cd "$tree" && export TAG=$run OUT PYTHONPATH="$tree:/tmp/site" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
    && bash -c "$cmd") || status=1
done
exit $status
