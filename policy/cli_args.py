"""Command-line plumbing shared by every runnerlab command (explain, generate, ab, diff).

The rule: every flag is honoured or refused, and a refusal is one line on stderr,
`<prog>: error: --flag: why`, with exit status 2 — never a usage dump or a traceback.
The type functions below turn a bad value into that line, naming the flag (argparse adds
the flag name to an ArgumentTypeError's message).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from policy.config import resolve_device


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is the single line `<prog>: error: <message>` (exit 2).

    argparse's own error prints the whole usage first, which for the engine flags is
    dozens of lines that bury the one that matters."""

    def error(self, message: str) -> NoReturn:
        # argparse writes "argument --flag: ..."; the flag alone reads as the other errors do
        message = message.removeprefix("argument ")
        self.exit(2, f"{self.prog}: error: {message}\n")


def usage_error(prog: str, error: str | Exception) -> int:
    """Print a refusal found after parsing (flags that conflict, a configuration the
    engine refuses) as one line and return exit status 2."""
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
    return 2


def one_line(error: str | Exception) -> str:
    """An error as one line. pydantic's ValidationError spans several lines and ends with
    a URL; its field path and message are what a command-line user needs."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} "
                             f"(got {e.get('input')!r})" for e in errors())
        except (TypeError, KeyError):
            pass
    return " ".join(str(error).split())


def int_list(kind: str, minimum: int) -> Callable[[str], list[int]]:
    """Type for a comma-separated list of integers >= minimum, e.g. --batch-sizes 1,8,32."""

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"give at least one {kind}")
        values = []
        for item in items:
            try:
                values.append(int(item))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{item!r} is not an integer; expected comma-separated {kind}s "
                    f">= {minimum}, e.g. {max(minimum, 1)},{max(minimum, 1) * 8}") from None
            if values[-1] < minimum:
                raise argparse.ArgumentTypeError(f"{kind} {values[-1]} is not valid; "
                                                 f"expected integers >= {minimum}")
        return values

    return parse


def bounded_int(minimum: int) -> Callable[[str], int]:
    """Type for one integer >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not valid; expected an integer "
                                             f">= {minimum}")
        return value

    return parse


def name_list(kind: str, choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Type for a comma-separated list of names from `choices` (duplicates dropped)."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"give at least one {kind}")
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(bad)}; accepted: {', '.join(choices)}")
        return list(dict.fromkeys(items))

    return parse


def cpu_noop_refusal(args: argparse.Namespace, device: str) -> str | None:
    """Engine flags that change nothing on the CPU (the engine accepts them everywhere)."""
    if (hasattr(args, "gpu_memory_utilization")
            and resolve_device(device, check_available=False) == "cpu"):
        return ("--gpu-memory-utilization has no effect on the CPU (its KV cache is sized "
                "from max_model_len and max_num_seqs); use --num-gpu-blocks-override")
    return None
