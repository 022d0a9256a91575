"""Eviction policies (LRU, S3-FIFO, ARC, LFU), demotion admission and per-tenant quotas."""
