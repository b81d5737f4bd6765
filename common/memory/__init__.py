"""Device-memory accounting, the per-GPU budget ledger and stress-and-cap for stages."""
