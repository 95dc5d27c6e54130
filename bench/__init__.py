"""tierd benchmarks: ``python -m bench.run`` (see README, "Performance")."""
