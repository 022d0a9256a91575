"""The pool's free queue: a doubly linked list threaded through the block objects."""

from __future__ import annotations

from collections.abc import Iterator

from tiers.keys import BlockHash, BlockKey


class PoolBlock:
    """Metadata of one pool block (the KV lives in the pool's tensor at `block_id`).

    `block_hash` is set while the block is cached (full and registered), else None; `tokens`,
    `parent`, `extras` and `tenant` are then those of the key it was registered under (`key`:
    demoted with it, and in its changes); the pool checks `tokens` on hits when it verifies them.
    """

    __slots__ = ("block_hash", "block_id", "extras", "next_free", "parent", "prev_free", "ref_cnt", "tenant",
                 "tokens")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.tokens = b""
        self.parent: bytes | None = None
        self.extras: bytes | None = None
        self.tenant = b""
        self.prev_free: PoolBlock | None = None
        self.next_free: PoolBlock | None = None

    @property
    def key(self) -> BlockKey | None:
        """The key the block is cached under (None: not cached)."""
        h = self.block_hash
        return None if h is None else BlockKey(h, self.tokens, self.parent, self.extras, self.tenant)

    def cache(self, key: BlockKey) -> None:
        """Mark the block cached under `key`."""
        self.block_hash, self.tokens, self.parent, self.extras, self.tenant = key

    def uncache(self) -> None:
        """Mark the block not cached."""
        self.block_hash, self.tokens, self.parent, self.extras, self.tenant = None, b"", None, None, b""

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"PoolBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is evicted (reused) first.

    Invariant: exactly the blocks with `ref_cnt == 0` are linked, each once, between the
    sentinels. Every operation is O(1) and allocates nothing: it rewires the blocks' own
    `prev_free` / `next_free` pointers. Among blocks freed together the caller appends a
    sequence's tail first, so the tail is evicted before its prefix.
    """

    def __init__(self, blocks: list[PoolBlock]) -> None:
        self._head = PoolBlock(-1)  # sentinels
        self._tail = PoolBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> PoolBlock:
        """Unlink and return the head block. Raises `IndexError` when empty."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("free queue is empty")
        self.remove(first)
        return first

    def remove(self, block: PoolBlock) -> None:
        """Unlink `block` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue (a bug)")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: PoolBlock) -> None:
        """Link `block` at the tail (evicted last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue (a bug)")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def move_to_tail(self, block: PoolBlock) -> None:
        self.remove(block)
        self.append(block)

    def move_to_head(self, block: PoolBlock) -> None:
        """Relink `block` at the head (reused first): for blocks whose content is dropped."""
        self.remove(block)
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[PoolBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def ids(self) -> list[int]:
        """Block ids from head to tail (for tests and debugging)."""
        return [b.block_id for b in self]
