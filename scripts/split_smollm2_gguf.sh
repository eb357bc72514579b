#!/usr/bin/env bash
# Split the installed SmolLM2 GGUF into two parts under the ignored .smol/ folder, each
# small enough for one device-tool call (64 MiB with the tree and .whl); the
# gpu_check.sh stages gguf_part0 and ngram join them on the GPU machine. Also fetches
# the gguf wheel into .whl. Run from the repository root, in the project's venv.
set -euo pipefail
src=$(python3 -c "from shared.model.gguf import find_smollm2_gguf; print(find_smollm2_gguf())" 2>/dev/null | tail -1)
mkdir -p .smol
grep -qx "/.smol/" .git/info/exclude 2>/dev/null || echo "/.smol/" >> .git/info/exclude
split -b 47M -d "$src" .smol/gguf.part
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d .whl "gguf==$(python3 -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"
ls -l .smol
sha256sum "$src"
