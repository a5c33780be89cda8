"""`pacer-demo`: the Space's modules are checked before `demo.py`, which imports gradio at its top, is imported."""

import sys

from .extras import MissingExtra, require


def main(argv=None) -> int:
    try:
        require("demo", "pacer-demo (the Space)")
    except MissingExtra as error:
        print(f"pacer-demo: error: {error}", file=sys.stderr)
        return 2
    from .demo import main as run

    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
