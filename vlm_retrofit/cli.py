"""Command line: `python -m vlm_retrofit <subcommand> ...`, callable in-process as `main([...])`."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

# Subcommands implemented outside this file, imported only when used so `--help` stays fast.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("vlm_retrofit.demo", "main"),
    "shards": ("vlm_retrofit.datamodules.shards", "main"),
}


def _load(name: str) -> Callable[[list[str]], int | None]:
    module, attr = SUBCOMMANDS[name]
    return getattr(importlib.import_module(module), attr)


def _usage() -> str:
    return "usage: python -m vlm_retrofit {" + ",".join(SUBCOMMANDS) + "} [options]  (see <subcommand> --help)"


def main(args: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit status (0 on success)."""
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"unknown subcommand {command!r}. {_usage()}", file=sys.stderr)
        return 2
    status = _load(command)(rest)
    return int(status or 0)
