"""The CPU tier: a preallocated (pinned with CUDA) slab and its residency bookkeeping."""
