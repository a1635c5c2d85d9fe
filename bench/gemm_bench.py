"""The GEMM benchmark as a plain script (no pytest): the same suite as the CLI.

    python bench/gemm_bench.py [--quick] [--dtype float32] [--threads 1] [--out DIR]

It is ``python -m tilegemm bench --op gemm`` with the options passed through.
"""
import sys

from tilegemm.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--op", "gemm", *sys.argv[1:]]))
