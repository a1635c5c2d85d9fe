"""Micro-kernel generator, kernel registry and the five-loop GEMM driver."""
