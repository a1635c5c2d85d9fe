"""``python -m tilegemm.ladder``: the same as ``tilegemm ladder``."""
import sys

from tilegemm.ladder.table import main

if __name__ == "__main__":
    sys.exit(main())
