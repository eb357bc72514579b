"""Benchmark and differential harnesses behind `runnerlab ab` and `runnerlab diff`."""
