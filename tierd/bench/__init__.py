"""tierd benchmarks: ``python -m tierd.bench.run`` (see README, "Performance")."""
