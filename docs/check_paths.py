"""Check that every file path the docs name exists.

Scans README.md and docs/**/*.md for markdown link targets and for repository paths
(tokens starting with policy/, shared/, runner_v1/, runner_v2/, scripts/, tests/, docs/,
.ci/), and the .py/.sh files for the docs/ paths their comments cite. A module path with
an attribute (`runner_v1/sampler.greedy_argmax`) resolves through its .py file; a glob
must match a file. A journal (docs/journal/) is a record: it may name a path that has
since been removed, if its "Paths since removed" list names the path and the commit that
removed it (checked with git). Exit status 1 on any miss.

    python docs/check_paths.py [-v]
"""

from __future__ import annotations

import glob
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("policy", "shared", "runner_v1", "runner_v2", "scripts", "tests", "docs", ".ci")
ROOT_ALTERNATIVES = "|".join(re.escape(r) for r in ROOTS)
PATH = re.compile(r"(?<![\w./-])((?:" + ROOT_ALTERNATIVES + r")/[\w./*-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
REMOVED = re.compile(r"^- `([^`]+)`: removed in ([0-9a-f]{7,40})\b", re.M)
SKIP_DIRS = {".git", ".venv", ".ci-venv", "node_modules", ".whl"}


def resolves(path: str, base: Path) -> bool:
    path = path.rstrip(".,;:")
    if "*" in path:
        return bool(glob.glob(str(base / path)))
    candidate = base / path
    while True:
        if candidate.exists() or candidate.with_name(candidate.name + ".py").exists():
            return True
        if "." not in candidate.name:  # strip a trailing .attribute and retry
            return False
        candidate = candidate.with_name(candidate.name.rsplit(".", 1)[0])


def removed_ok(path: str, commit: str) -> bool:
    """`path` existed just before `commit` and not at it."""
    def exists_at(rev: str) -> bool:
        return subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT,
                              capture_output=True).returncode == 0
    return exists_at(f"{commit}^") and not exists_at(commit)


def doc_references(doc: Path) -> list[tuple[int, str, Path]]:
    """(line, reference, directory it is relative to) for one markdown file."""
    refs = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            refs.append((n, target.split("#")[0], doc.parent))
        for path in PATH.findall(LINK.sub("](...)", line)):
            refs.append((n, path, ROOT))
    return refs


def code_references(source: Path) -> list[tuple[int, str, Path]]:
    """docs/ paths cited in a .py/.sh file (comments, docstrings)."""
    return [(n, path, ROOT) for n, line in enumerate(source.read_text().splitlines(), 1)
            for path in PATH.findall(line) if path.startswith("docs/")]


def files(pattern: str) -> list[Path]:
    return sorted(p for p in ROOT.glob(pattern)
                  if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts))


def main() -> int:
    verbose = "-v" in sys.argv
    checked = missing = 0
    sources = [(d, doc_references) for d in [ROOT / "README.md", *files("docs/**/*.md")]]
    sources += [(s, code_references) for s in files("**/*.py") + files("**/*.sh")]
    for source, extract in sources:
        removed = dict(REMOVED.findall(source.read_text())) if "journal" in source.parts else {}
        for n, ref, base in extract(source):
            checked += 1
            where = f"{source.relative_to(ROOT)}:{n}"
            if resolves(ref, base):
                if verbose:
                    print(f"ok       {where}: {ref}")
            elif ref.rstrip(".,;:") in removed and removed_ok(ref.rstrip(".,;:"),
                                                              removed[ref.rstrip(".,;:")]):
                if verbose:
                    print(f"removed  {where}: {ref} (in {removed[ref.rstrip('.,;:')]})")
            else:
                missing += 1
                print(f"MISSING  {where}: {ref}")
    print(f"{checked} references checked, {missing} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
