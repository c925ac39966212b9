"""Throughput benchmarks (`podray bench ...`): speed is measured here, never by timed tests."""
