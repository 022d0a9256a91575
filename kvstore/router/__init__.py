"""KV-aware routing: an index of which engine instance holds which block in which tier, fed
by KV events (`kvstore.events`, and vLLM's own), and `kvstrata router`, the HTTP service that
answers "which instance holds the longest prefix of these tokens?" (docs/routing.md)."""
