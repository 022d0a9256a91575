"""A store in its own process, driven over stdin, for the router's real-process tests.

`python -m tests.fleet_instance PORT ID DISK_DIR CPU_BLOCKS [REMOTE_URL [NAMESPACE]]`
publishes KV events on tcp://127.0.0.1:PORT (replay on PORT + 1); then one JSON command per
line: {"op": "store", "tokens": [...], "salt": null}, {"op": "where", "tokens": [...]} (the
tier of each block of the cached prefix), {"op": "flush"}, {"op": "clear"}, {"op": "close"}.
Each answers one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

from kvstore import KVCacheStore, StoreConfig
from kvstore.hashing import ExtraKeys
from tests.conftest import BLOCK, LAYOUT


def main() -> None:
    port, instance_id, disk, cpu_blocks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    remote = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None
    namespace = sys.argv[6] if len(sys.argv) > 6 else "default"
    store = KVCacheStore(StoreConfig(
        LAYOUT, block_size=BLOCK, cpu_bytes=cpu_blocks * LAYOUT.block_bytes(BLOCK), disk_path=disk or None,
        disk_bytes=16 << 20, disk_sync=False, events_endpoint=f"tcp://127.0.0.1:{port}", instance_id=instance_id,
        remote_url=remote, namespace=namespace))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "store":
            tokens = cmd["tokens"]
            kv = torch.zeros(LAYOUT.block_shape(len(tokens)), dtype=LAYOUT.dtype)
            salt = cmd.get("salt")
            reply: object = store.store(tokens, kv, extra_keys=ExtraKeys(cache_salt=salt) if salt else None)
        elif op == "where":
            salt = cmd.get("salt")
            where = store.locate(cmd["tokens"], extra_keys=ExtraKeys(cache_salt=salt) if salt else None)
            reply = [kind.value for kind in where]
        elif op == "flush":
            reply = store.flush()
        elif op == "clear":
            store.clear()
            reply = True
        elif op == "close":
            store.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        else:
            reply = {"error": op}
        print(json.dumps({"ok": reply}), flush=True)


if __name__ == "__main__":
    main()
