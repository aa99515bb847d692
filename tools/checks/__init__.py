"""Checks too long or too tool-bound for the test suite: the serve fuzzer, the CUDA compile check."""
