"""What signing KV records (--kv-remote-key-file, kv/tiers/signing.py) costs: per record of a real
model's block, the time to encode and decode it with and without a key, and a store-then-load round
trip through the disk tier and the Redis tier (a redis-server on loopback, started here) with and
without one, alone and as the engine does it (the block gathered from the pool and encoded, or decoded
and written into a pool block). Prints each path's ratio signed / unsigned and the signature's share.

    .venv/bin/python bench/record_signing.py                       # Gemma 3 270M and SmolLM2 (~1 min)
    .venv/bin/python bench/record_signing.py --models gemma-3-270m --records 400
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from kvserve import LLM  # noqa: E402
from kvserve.kv.hashing import root_hash  # noqa: E402
from kvserve.kv.tiers import DiskStore  # noqa: E402
from kvserve.kv.tiers.record import BlockRecord, decode_record, encode_record, record_key  # noqa: E402
from kvserve.kv.tiers.remote import RemoteStore  # noqa: E402
from kvserve.kv.tiers.signing import RecordSigner  # noqa: E402
from redis_server import RedisServer  # noqa: E402


def per_record(fn, records: list, rounds: int) -> list[float]:
    """Seconds fn takes per record, one mean per round."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for record in records:
            fn(record)
        times.append((time.perf_counter() - start) / len(records))
    return times


def paired(plain, signed, records: list, rounds: int) -> tuple[float, float]:
    """Medians of plain's and signed's per-record seconds, measured in alternating rounds."""
    a, b = [], []
    for _ in range(rounds):
        a += per_record(plain, records, 1)
        b += per_record(signed, records, 1)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct")
    parser.add_argument("--records", type=int, default=200, help="records per round")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    signer = RecordSigner(os.urandom(32))
    print("| model | record | sign µs | check µs | tier | store µs | load µs | sign / store | check / load | "
          "engine store µs | engine load µs | sign / engine store | check / engine load | store + load, MB/s: no key → key |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with RedisServer() as redis_server, tempfile.TemporaryDirectory() as tmp:
        remote = RemoteStore(redis_server.url, timeout_ms=5000)
        for model in args.models.split(","):
            llm = LLM(model, num_kv_blocks=8)
            identity = root_hash(llm.engine.cache_identity)
            pool = llm.engine.pool
            payload = pool.block_bytes(0)
            block = llm.engine.kv.block_size
            records = [BlockRecord((i + 1) << 64, 0, tuple(range(block)), payload) for i in range(args.records)]
            keys = {r.block_hash: record_key(r.block_hash, 0) for r in records}
            encoded = {s: {r.block_hash: encode_record(r, identity, signer if s else None) for r in records} for s in (False, True)}
            size = len(encoded[True][records[0].block_hash])
            plain, signed = paired(lambda r: encode_record(r, identity), lambda r: encode_record(r, identity, signer), records, args.rounds)
            sign = signed - plain
            plain, signed = paired(lambda r: decode_record(encoded[False][r.block_hash], identity, keys[r.block_hash]),
                                   lambda r: decode_record(encoded[True][r.block_hash], identity, keys[r.block_hash], signer),
                                   records, args.rounds)  # fmt: skip
            check = signed - plain
            for name, store in (("disk", DiskStore(Path(tmp) / model, 4 << 30)), ("redis", remote)):
                def put(r, s=False, store=store):
                    store.put(keys[r.block_hash], encode_record(r, identity, signer if s else None))

                def get(r, s=False, store=store):
                    decode_record(store.get(keys[r.block_hash]), identity, keys[r.block_hash], signer if s else None)

                # the engine's own path (KVOffloader): the block gathered from the pool, encoded and
                # stored; loaded, decoded and written back into a pool block
                def engine_put(r, store=store):
                    record = BlockRecord(r.block_hash, 0, r.token_ids, pool.block_bytes(0))
                    store.put(keys[r.block_hash], encode_record(record, identity))

                def engine_get(r, store=store):
                    pool.write_block_bytes(1, decode_record(store.get(keys[r.block_hash]), identity, keys[r.block_hash]).payload)

                stored, _ = paired(put, put, records, args.rounds)
                loaded, _ = paired(get, get, records, args.rounds)
                engine_stored, _ = paired(engine_put, engine_put, records, args.rounds)
                engine_loaded, _ = paired(engine_get, engine_get, records, args.rounds)
                plain, signed = paired(lambda r: (put(r), get(r)), lambda r: (put(r, True), get(r, True)), records, args.rounds)
                print(f"| {model} | {size / 1024:.0f} KiB | {sign * 1e6:.1f} | {check * 1e6:.1f} | {name} | {stored * 1e6:.0f} | "
                      f"{loaded * 1e6:.0f} | {sign / stored * 100:.1f}% | {check / loaded * 100:.1f}% | {engine_stored * 1e6:.0f} | "
                      f"{engine_loaded * 1e6:.0f} | {sign / engine_stored * 100:.1f}% | {check / engine_loaded * 100:.1f}% | "
                      f"{2 * size / plain / 1e6:.0f} → {2 * size / signed / 1e6:.0f} ({plain / signed:.2f}x) |", flush=True)  # fmt: skip
        remote.close()


if __name__ == "__main__":
    main()
