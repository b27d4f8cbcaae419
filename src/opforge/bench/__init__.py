"""Benchmark harness: timing, bandwidth ceilings, and (per op) bench cases."""
