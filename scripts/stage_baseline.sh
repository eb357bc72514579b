#!/usr/bin/env bash
# Stage a baseline for an A/B on the GPU machine, whose copy of the repository may carry
# a stale .git: the files that differ between BASE and the working tree, as BASE has them,
# under .baseline/ (git-ignored; name it in the device tool's `carry`), for
# scripts/gpu_ab_baseline.sh to lay over a copy of the tree there.
#
#   scripts/stage_baseline.sh BASE        (a commit; run from the repository root)
set -euo pipefail
base=$(git rev-parse --verify "${1:?usage: scripts/stage_baseline.sh BASE}^{commit}")
rm -rf .baseline
mkdir -p .baseline/files
: > .baseline/added.txt
git diff --name-only "$base" -- shared runner_v1 runner_v2 policy scripts | while read -r f; do
  if git cat-file -e "$base:$f" 2>/dev/null; then
    mkdir -p ".baseline/files/$(dirname "$f")"
    git show "$base:$f" > ".baseline/files/$f"
  else
    echo "$f" >> .baseline/added.txt  # not in BASE: removed from the baseline tree
  fi
done
git ls-files --others --exclude-standard -- shared runner_v1 runner_v2 policy scripts \
  >> .baseline/added.txt  # untracked files are not in BASE either
echo "$base" > .baseline/commit
echo "staged $(find .baseline/files -type f | wc -l) files of ${base:0:7}, $(wc -l < .baseline/added.txt) to remove"
