"""A store in its own process, driven over stdin, for the router's real-process tests.

`python -m tests.fleet_instance PORT ID DISK_DIR CPU_BLOCKS [REMOTE_URL]`; then one JSON
command per line: {"op": "store", "tokens": [...]}, {"op": "where", "tokens": [...]} (the
tier of each block of the cached prefix), {"op": "flush"}, {"op": "close"}. Each answers one
JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

from kvstore import KVCacheStore, StoreConfig
from tests.conftest import BLOCK, LAYOUT


def main() -> None:
    port, instance_id, disk, cpu_blocks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    remote = sys.argv[5] if len(sys.argv) > 5 else None
    store = KVCacheStore(StoreConfig(
        LAYOUT, block_size=BLOCK, cpu_bytes=cpu_blocks * LAYOUT.block_bytes(BLOCK), disk_path=disk or None,
        disk_bytes=16 << 20, disk_sync=False, events_endpoint=f"tcp://127.0.0.1:{port}", instance_id=instance_id,
        remote_url=remote))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "store":
            tokens = cmd["tokens"]
            kv = torch.zeros(LAYOUT.block_shape(len(tokens)), dtype=LAYOUT.dtype)
            reply: object = store.store(tokens, kv, )
        elif op == "where":
            plan = store.stack.locate(store.block_hashes(cmd["tokens"]))
            reply = [store.tiers[i].kind.value for i in plan]
        elif op == "flush":
            reply = store.flush()
        elif op == "close":
            store.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        else:
            reply = {"error": op}
        print(json.dumps({"ok": reply}), flush=True)


if __name__ == "__main__":
    main()
