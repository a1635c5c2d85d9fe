"""``python -m tilegemm`` and the ``tilegemm`` console script (see :mod:`tilegemm.tools.cli`)."""
import sys


def main(argv=None):
    """Run the command line; returns the exit status."""
    from tilegemm.tools.cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
