"""`voice-agent` command line."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("voice-agent: not implemented yet", file=sys.stderr)
    return 2
