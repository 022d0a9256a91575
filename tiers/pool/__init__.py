"""The GPU block pool (tier 0): paged KV, reference counts, the intrusive free queue."""
