"""Storage tiers: the shared-memory host pool and the NVMe file."""
