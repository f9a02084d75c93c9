"""Rewrites the field reference of docs/configuration.md from the config schema.

python -m experiments.config_docs            # or: make config-docs
python -m experiments.config_docs --check    # exit 1 if the page is stale
"""

from __future__ import annotations

import os
import sys

from policyopt.config import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str]) -> int:
    path = os.path.join(ROOT, reference.PAGE)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    fresh = reference.update_page(text)
    if "--check" in argv:
        if fresh != text:
            print(f"{reference.PAGE} is stale: run `{reference.COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if fresh != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(fresh)
        print(f"rewrote the field reference of {reference.PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
