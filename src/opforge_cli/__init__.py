"""Entry point of the ``opforge`` command.

Build-tool commands (``cache``, ``doctor``, ``new``) must run when opforge's
kernels are missing or broken (that is when they are needed most), so they
import opforge without loading its kernels. Everything else loads them.
"""

import os
import sys

TOOLING_COMMANDS = {"cache", "doctor", "new"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLING_COMMANDS:
        os.environ["_OPFORGE_TOOLING_ONLY"] = "1"
    from opforge.cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
