"""Throughput benchmarks (`podray bench ...`)."""
