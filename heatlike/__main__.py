"""``python -m heatlike script.py [args]``: run a script so that an uncaught exception on any rank
aborts the whole MPI job (rank and traceback printed) instead of leaving the others hanging."""

import sys

from .utils.launch import run_script


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) >= 2 else 2
    run_script(sys.argv[1], sys.argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
