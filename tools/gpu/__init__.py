"""The GPU benchmark harness: packed on a CPU machine, built and run on a lent GPU machine."""
