"""Vector-IR kernel generators (one module per family), the kernel registry and the GEMM driver."""
