"""`kvstrata router`: a KV-aware routing service. It subscribes to KV events in vLLM's wire
format (from kvstrata stores and vLLM engines alike), indexes which instance holds which
block in which tier by its own chain of token ids, and answers `POST /lookup`: which instance
holds the longest prefix of a request (docs/routing.md, docs/security.md)."""
