"""Deployments and helpers used only by the live (Ray Serve) benchmarks."""
