"""vLLM integration: `TierKVConnector` (scheduler and worker sides) and its parts."""
