"""Side-by-side benchmarks of matrixfsdp against its baselines (``python -m benchmarks.run``)."""
