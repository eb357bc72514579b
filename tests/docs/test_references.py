"""Every path the docs and code comments name exists, and every `path:line` reference in
the docs points at the symbol it names (docs/check_paths.py): a moved file or a shifted
definition fails here, not in a newcomer's hands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_references_resolve() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "check_paths.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " 0 missing" in proc.stdout and " 0 wrong" in proc.stdout
