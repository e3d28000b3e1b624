"""Check (or rewrite) the tables of README.md and docs/*.md against their result files.

python benchmarks/render_tables.py            # exit 1 and one line per difference
python benchmarks/render_tables.py --write    # rewrite the marked tables from the files
"""

from __future__ import annotations

import argparse
import sys

import doc_tables


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite the marked tables instead of checking them")
    args = p.parse_args(argv)
    if args.write:
        for name in doc_tables.write():
            print("rewrote", name)
    found = doc_tables.problems()
    print("\n".join(found) or "every table matches its files")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
