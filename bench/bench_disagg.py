"""What the prefill -> decode handoff costs, on this machine, with real processes and Mooncake TCP.

1. Handoff cost per request: one client, prompts of several lengths, through a unified engine and
   through prefill + decode. From decode's proof (prefill's timings) and decode's metrics: the
   KV transfer time, the checksum time on each side, and the checksum's share of request time
   (goal: under 2 %).
2. Throughput: closed-loop clients against unified vs prefill + decode; generated tokens/s.
3. The primitives at sizes closer to real models: Mooncake TCP loopback MB/s (two transfer
   engines in this process) and checksum MB/s.

Uses a random tiny Llama (``kvguard.testing.write_tiny_checkpoint``: 2 layers, 2 KV heads of 16;
512 bytes of KV per token), so model compute is small and handoff overheads are as visible as
they can get. ``python -m bench.bench_disagg [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import httpx

from bench.summary import emit
from kvguard.testing import EngineProcess, launch_engine, write_tiny_checkpoint

CHECKSUM_GOAL = 0.02
ENV = {"KVGUARD_SERVED_MODEL_NAME": "tiny", "GLOG_minloglevel": "2"}
POOL = {"pool_tokens": 8192, "page_size": 16}


def _body(n_tokens: int, max_tokens: int, salt: int) -> dict[str, Any]:
    prompt = (f"{salt:04d} " + "lorem ipsum dolor sit amet " * 200)[: n_tokens - 1]
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def _histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram from /metrics."""
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(name + "_count"):
            count = float(line.split()[-1])
    return total, count


def per_request(unified: str, decode: str, lengths: Sequence[int], repeats: int) -> bool:
    print("1. handoff cost per request (1 client, max_tokens=8, medians)")
    head = (
        f"{'prompt':>6} {'unified ms':>10} {'disagg ms':>9} {'ratio':>6} {'transfer ms':>11} "
        f"{'cksum P ms':>10} {'cksum D ms':>10} {'cksum share':>11}"
    )
    print(head)
    ok = True
    with httpx.Client(timeout=120) as client:
        for n in lengths:
            for url in (unified, decode):  # warm-up
                client.post(url + "/v1/completions", json=_body(n, 8, 0))
            before = _histogram(decode, "kvguard_engine_kv_checksum_seconds")
            u_ms, d_ms, transfer, cksum_p = [], [], [], []
            for i in range(repeats):
                started = time.perf_counter()
                client.post(unified + "/v1/completions", json=_body(n, 8, i + 1))
                u_ms.append((time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                proof = client.post(decode + "/v1/completions", json=_body(n, 8, i + 1)).json()[
                    "kvguard"
                ]["handoff"]
                d_ms.append((time.perf_counter() - started) * 1000)
                transfer.append(proof["transfer_ms"])
                cksum_p.append(proof["checksum_ms"])
            after = _histogram(decode, "kvguard_engine_kv_checksum_seconds")
            cksum_d = (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1000
            u, d = statistics.median(u_ms), statistics.median(d_ms)
            share = (statistics.median(cksum_p) + cksum_d) / d
            ok &= share < CHECKSUM_GOAL
            emit(
                "disagg",
                f"checksum share of request time, {n}-token prompt",
                f"{share:.2%}",
                f"< {CHECKSUM_GOAL:.0%}",
                share < CHECKSUM_GOAL,
            )
            print(
                f"{n:6d} {u:10.1f} {d:9.1f} {d / u:6.2f} {statistics.median(transfer):11.2f} "
                f"{statistics.median(cksum_p):10.3f} {cksum_d:10.3f} {share:10.2%}"
            )
    return ok


async def _closed_loop(url: str, n: int, concurrency: int, prompt: int, max_tokens: int) -> float:
    generated = 0

    async def client_loop(j: int, http: httpx.AsyncClient) -> None:
        nonlocal generated
        for i in range(j, n, concurrency):
            body = _body(prompt, max_tokens, 1000 + i)
            response = await http.post(url + "/v1/completions", json=body)
            generated += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=300) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(j, http) for j in range(concurrency)))
        return generated / (time.perf_counter() - started)


def throughput(unified: str, decode: str, n: int, concurrency: int) -> None:
    print(f"\n2. throughput ({n} requests, {concurrency} closed-loop clients)")
    print(
        f"{'prompt':>6} {'max_tokens':>10} {'unified tok/s':>13} {'disagg tok/s':>12} {'ratio':>6}"
    )
    for prompt, max_tokens in ((128, 32), (1024, 16)):
        u = asyncio.run(_closed_loop(unified, n, concurrency, prompt, max_tokens))
        d = asyncio.run(_closed_loop(decode, n, concurrency, prompt, max_tokens))
        print(f"{prompt:6d} {max_tokens:10d} {u:13.0f} {d:12.0f} {d / u:6.2f}")
        emit(
            "disagg",
            f"tok/s disaggregated / unified, {prompt}-token prompts, {concurrency} clients",
            f"{d / u:.2f}x",
        )


def primitives(sizes_mb: Sequence[int]) -> None:
    import torch
    from mooncake.engine import TransferEngine

    from backend.disagg.kvio import kv_digest
    from backend.model.kv_cache import KVCache

    print("\n3. primitives (this process; KV of a 32-layer, 8x128-head fp16 model per token)")
    print(
        f"{'MB':>6} {'tokens':>7} {'mooncake TCP MB/s':>17} {'crc32 MB/s':>10} {'sha256 MB/s':>11}"
    )
    sender, receiver = TransferEngine(), TransferEngine()
    for engine in (sender, receiver):
        engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    target = f"127.0.0.1:{receiver.get_rpc_port()}"
    for mb in sizes_mb:
        size = mb * 1024 * 1024
        src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
        sender.register_memory(src.data_ptr(), size)
        receiver.register_memory(dst.data_ptr(), size)
        sender.transfer_sync_write(target, src.data_ptr(), dst.data_ptr(), size)  # warm-up
        started = time.perf_counter()
        rc = sender.transfer_sync_write(target, src.data_ptr(), dst.data_ptr(), size)
        moved = size / (time.perf_counter() - started) / 1e6
        assert rc == 0
        token_bytes = 32 * 2 * 8 * 128 * 2
        tokens = size // token_bytes
        pages = -(-tokens // 16)
        kv = KVCache(32, pages, 16, 8, 128, torch.float16, "cpu")
        rates = []
        for algorithm in ("crc32", "sha256"):
            started = time.perf_counter()
            kv_digest(kv.k, kv.v, list(range(pages)), tokens, algorithm)
            rates.append(tokens * token_bytes / (time.perf_counter() - started) / 1e6)
        print(f"{mb:6d} {tokens:7d} {moved:17.0f} {rates[0]:10.0f} {rates[1]:11.0f}")
        sender.unregister_memory(src.data_ptr())
        receiver.unregister_memory(dst.data_ptr())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    args = parser.parse_args(argv)
    repeats, n = (5, 16) if args.quick else (15, 48)
    os.environ.setdefault("GLOG_minloglevel", "2")
    engines: list[EngineProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_checkpoint(tmp)
        try:
            engines.append(launch_engine(model, "unified", ENV, **POOL))
            engines.append(launch_engine(model, "prefill", ENV, **POOL))
            engines.append(launch_engine(model, "decode", ENV, prefill_url=engines[1].url, **POOL))
            unified, decode = engines[0].url, engines[2].url
            time.sleep(1.5)  # decode's first read of prefill's capacity
            ok = per_request(unified, decode, (64, 512, 2048), repeats)
            throughput(unified, decode, n, 8)
        finally:
            for engine in engines:
                engine.stop()
    primitives((4, 64) if args.quick else (4, 64, 256))
    print(f"\nchecksum share goal < {CHECKSUM_GOAL:.0%}: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
