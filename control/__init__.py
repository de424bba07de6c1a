"""The Redis control plane (never the KV data path), all keys under `pdserve:{app}:`.

| module | what it holds |
|---|---|
| `keys.py` | the one key schema |
| `records.py` | what is stored (SLO, bounds, decisions, replica status), JSON codecs (pure) |
| `store.py` | `ControlStore`, the async face: replica status, prefix index, latency samples |
| `sync_store.py` | `SyncControlStore`, the sync face: SLO, bounds, pins, decision log |
| `redis_server.py` | a private redis-server for local mode (password on stdin) |
"""
