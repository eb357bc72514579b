"""Check that every file path the docs name exists.

Scans README.md and docs/**/*.md for markdown link targets and for repository paths
(tokens starting with policy/, shared/, runner_v1/, runner_v2/, scripts/, tests/, docs/,
.ci/), and the .py/.sh files for the docs/ paths their comments cite. A module path with
an attribute (`runner_v1/sampler.greedy_argmax`) resolves through its .py file; a glob
must match a file. A journal (docs/journal/) is a record: it may name a path that has
since been removed, if its "Paths since removed" list names the path and the commit that
removed it (checked with git).

Line references. In README.md and docs/**/*.md outside docs/journal/ (a journal's line
numbers describe the code of its day), a reference to a line is written

    [`runner_v1/model_runner.py:87`](../runner_v1/model_runner.py#L87) `execute_model`

or, without the link, `runner_v1/model_runner.py:87` `execute_model`: the path in
backticks, a colon and the line number, then (after spaces) the symbol in backticks.
For each one the checker requires that the file exists and has at least that many lines,
that a link goes to the same file with the anchor #L<same line>, and that the symbol is
given and its name (the part after the last dot: `Sampler.__call__` -> `__call__`) occurs
as a whole word on that line. Point at the symbol's def / class / assignment line. When
code moves, a stale reference is reported with the line(s) where the name is now defined.

Exit status 1 on any missing path or wrong line reference. `--fix` first moves every
stale line reference whose symbol is now defined at exactly one line of its file to
that line (text and anchor), then checks; anything else stays for a person to fix.

    python docs/check_paths.py [-v] [--fix]
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
# `path:N`, optionally linked ([`path:N`](target)), optionally followed by `symbol`.
LINE_REF = re.compile(
    r"(?<![\w./-])`(?P<path>(?:" + ROOT_ALTERNATIVES + r")/[\w./-]+):(?P<line>\d+)`"
    r"(?:\]\((?P<target>[^)\s]+)\))?"
    r"(?:[ \t]+`(?P<symbol>[A-Za-z_][\w.]*)`)?"
)


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


def line_reference_error(doc: Path, match: re.Match) -> str | None:
    """What is wrong with one `path:N` `symbol` reference of `doc`, or None."""
    path, number, target, symbol = match.group("path", "line", "target", "symbol")
    n = int(number)
    source = ROOT / path
    if not source.is_file():
        return f"{path} is not a file"
    lines = source.read_text().splitlines()
    if not 1 <= n <= len(lines):
        return f"{path} has {len(lines)} lines, not {n}"
    if target is not None:
        target_path, _, anchor = target.partition("#")
        if (doc.parent / target_path).resolve() != source.resolve():
            return f"the link goes to {target_path}, not to {path}"
        if anchor != f"L{n}":
            return f"the link's anchor is #{anchor}, not #L{n}"
    if symbol is None:
        return "no `symbol` follows it, so the line cannot be checked"
    name = symbol.rsplit(".", 1)[-1]
    if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", lines[n - 1]):
        return None
    defined = defined_lines(path, name)
    where = (f"`{name}` is defined at line {', '.join(map(str, defined[:5]))}" if defined
             else f"`{name}` is defined nowhere in {path}")
    return f"line {n} reads {lines[n - 1].strip()[:60]!r}; {where}"


def defined_lines(path: str, name: str) -> list[int]:
    """Lines of `path` where `name` is defined (def / class / assignment)."""
    lines = (ROOT / path).read_text().splitlines()
    return [i for i, text in enumerate(lines, 1) if re.match(
        rf"\s*(?:(?:async\s+)?def|class)\s+{re.escape(name)}\b|\s*{re.escape(name)}\s*[:=]",
        text)]


def fix_line_references() -> int:
    """Move stale references to their symbol's one definition; -> how many moved."""
    moved = 0
    for doc in line_reference_docs():
        text = doc.read_text()

        def repoint(match: re.Match) -> str:
            nonlocal moved
            path, symbol = match.group("path", "symbol")
            if symbol is None or not (ROOT / path).is_file() or \
                    line_reference_error(doc, match) is None:
                return match.group(0)
            where = defined_lines(path, symbol.rsplit(".", 1)[-1])
            if len(where) != 1:
                return match.group(0)
            moved += 1
            old = match.group("line")
            fixed = match.group(0).replace(f"{path}:{old}`", f"{path}:{where[0]}`", 1)
            return fixed.replace(f"#L{old})", f"#L{where[0]})", 1)

        new = LINE_REF.sub(repoint, text)
        if new != text:
            doc.write_text(new)
    return moved


def line_reference_docs() -> list[Path]:
    return [d for d in [ROOT / "README.md", *files("docs/**/*.md")]
            if "journal" not in d.relative_to(ROOT).parts]


def check_line_references(verbose: bool) -> tuple[int, int]:
    """-> (references checked, references wrong); prints the wrong ones."""
    checked = wrong = 0
    for doc in line_reference_docs():
        for n, text in enumerate(doc.read_text().splitlines(), 1):
            for match in LINE_REF.finditer(text):
                checked += 1
                where = f"{doc.relative_to(ROOT)}:{n}"
                ref = match.group("path") + ":" + match.group("line")
                error = line_reference_error(doc, match)
                if error is None:
                    if verbose:
                        print(f"ok       {where}: {ref} `{match.group('symbol')}`")
                else:
                    wrong += 1
                    print(f"WRONG    {where}: {ref}: {error}")
    return checked, wrong


def files(pattern: str) -> list[Path]:
    # dot-folders are local copies, caches and virtual environments, never the project
    return sorted(p for p in ROOT.glob(pattern)
                  if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)
                  and not any(part.startswith(".") for part in p.relative_to(ROOT).parts[:-1]))


def main() -> int:
    verbose = "-v" in sys.argv
    if "--fix" in sys.argv:
        print(f"{fix_line_references()} line references moved to their symbol's definition")
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
    line_checked, wrong = check_line_references(verbose)
    print(f"{line_checked} line references checked, {wrong} wrong")
    return 1 if missing or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
