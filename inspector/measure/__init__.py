"""Measurements taken on this machine: the kernel micro-benchmarks of `inspect-model calibrate`."""
