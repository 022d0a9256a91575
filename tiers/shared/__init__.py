"""Helpers several tiers share: host block copies, block batches, per-process shared objects."""
