"""python -m policy explain [--json] [--features] --model M [engine flags]
python -m policy features        (the feature-support table)"""

from __future__ import annotations

import sys

from policy.explain import explain_main, format_feature_table

USAGE = "usage: python -m policy {explain,features} ...  (python -m policy explain --help)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "explain":
        return explain_main(argv[1:])
    if argv and argv[0] == "features":
        print(format_feature_table())
        return 0
    print(USAGE, file=sys.stderr)
    return 0 if argv and argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
