"""Benchmarks on this machine, and the scripts that print the tables of docs/benchmarks.md, policies.md and
simulator.md."""
