"""The disk tier: slot files of checksummed payloads and the LMDB index (docs/disk-format.md)."""
