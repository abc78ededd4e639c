"""Compile the replay's hot modules (serving_integration/compiled.py), or say which run compiled.

    python -m serving_integration.build_compiled          # build what is missing (make setup runs it)
    python -m serving_integration.build_compiled status
"""

from __future__ import annotations

import os
import shutil
import sys

from serving_integration.compiled import SWITCH, build, enabled, status


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "build"
    if command == "build":
        if not enabled():
            print(f"{SWITCH}=0: not compiling; the modules run interpreted")
            return 0
        if shutil.which(os.environ.get("CC", "cc")) is None:
            print("compiling the replay's hot modules needs a C compiler (cc) and the Python headers; "
                  f"{SWITCH}=0 runs them interpreted (slower: docs/simulator.md)", file=sys.stderr)
            return 1
        built = build()
        print(f"compiled: {', '.join(n.rsplit('.', 1)[1] for n in built)}" if built else "compiled modules up to date")
        return 0
    if command == "status":
        for name, where in status().items():
            print(f"{name}: {where}")
        return 0
    print(f"usage: python -m serving_integration.build_compiled [build|status]; got {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
