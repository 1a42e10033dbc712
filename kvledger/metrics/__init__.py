"""Serving-metric definitions shared by the benchmark client and the simulator (torch-free)."""
