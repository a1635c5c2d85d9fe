"""Vector-IR kernel generators (one module per family), kernel registry and the five-loop GEMM driver."""
