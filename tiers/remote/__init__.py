"""The remote tier: Valkey/Redis standalone or cluster, its RESP client and self-checking record."""
