"""The reference runner: a paged-attention Llama over the block pool, and its block manager."""
