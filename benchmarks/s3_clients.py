"""Which client puts a 1 GiB file into the test S3 server fastest (issue 51 item 3's levers).

    .venv/bin/python benchmarks/s3_clients.py [--mib 1024] [--rounds 2] [--clients s3fs4,window4,store,boto4,boto10]

One ``moto_server`` (``tests/s3.py``, at nice 19 as in ``checkpoint_commit.py --store s3``), one
file of ``--mib`` MiB of random bytes, 8 MiB parts (``store.PART_BYTES``) for every client, and
the clients in turn, the order reversed every other round (A B ... B A), so every ratio is from
one run. For each put: seconds, this process's CPU seconds, the server's CPU seconds, and this
process's RSS growth (sampled every 10 ms). The clients:

* ``s3fs<n>``: ``S3FileSystem.put_file(chunksize=8 MiB, max_concurrency=n)`` through the Airflow
  connection's ``ObjectStoragePath`` (the store before issue 51, with n = 4);
* ``window<n>``: a sliding window of n parts over s3fs's own async client (``_call_s3``), each part
  read by a thread pool feeding the event loop (one lever the issue named);
* ``store``: ``store._put_parts``, what the store ships: boto3's transfer manager (4 threads) on a
  client made from what s3fs resolved;
* ``boto<n>``: boto3's ``upload_file`` with ``max_concurrency=n``, the anchor (boto3's default is 10).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_load  # noqa: E402


def s3fs_put(dest, local: Path, parts: int) -> None:
    from airflow_provider_horovod import store

    dest.fs.put_file(str(local), dest.path, chunksize=store.PART_BYTES, max_concurrency=parts)


async def _window(fs, local: str, bucket: str, key: str, parts: int, pool) -> None:
    from airflow_provider_horovod import store

    loop = asyncio.get_running_loop()
    size = os.path.getsize(local)
    upload = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    slots = asyncio.Semaphore(parts)
    fd = os.open(local, os.O_RDONLY)
    try:
        async def one(n: int) -> dict:
            async with slots:
                body = await loop.run_in_executor(pool, os.pread, fd, store.PART_BYTES, (n - 1) * store.PART_BYTES)
                out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"],
                                        PartNumber=n, Body=body)
                return {"PartNumber": n, "ETag": out["ETag"]}

        done = await asyncio.gather(*[one(n) for n in range(1, -(-size // store.PART_BYTES) + 1)])
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"],
                          MultipartUpload={"Parts": done})
    finally:
        os.close(fd)


def window(dest, local: Path, parts: int) -> None:
    from fsspec.asyn import sync

    bucket, key, _ = dest.fs.split_path(dest.path)
    with concurrent.futures.ThreadPoolExecutor(parts) as pool:
        sync(dest.fs.loop, _window, dest.fs, str(local), bucket, key, parts, pool)


def boto(server, bucket: str, local: Path, key: str, parts: int) -> None:
    from boto3.s3.transfer import TransferConfig

    from airflow_provider_horovod import store

    server.client().upload_file(str(local), bucket, key, Config=TransferConfig(multipart_chunksize=store.PART_BYTES,
                                                                               max_concurrency=parts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", default="s3fs4,window4,store,boto4,boto10")
    args = parser.parse_args()
    names = args.clients.split(",")
    from airflow_provider_horovod import store
    from tests import s3

    with s3.serving(nice=19) as server, tempfile.TemporaryDirectory(prefix="hvd-s3-clients-") as tmp:
        bucket = server.new_bucket()
        root = store.storage_path(s3.uri(bucket, "bench"))
        local = Path(tmp, "big.bin")
        with open(local, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(args.mib):
                f.write(block)
        print_load("at the start")
        took: dict[str, list[float]] = {}
        me, srv = psutil.Process(), psutil.Process(server.proc.pid)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                key = "%s-%d" % (name, r)
                cpu0, srv0, rss0 = sum(me.cpu_times()[:2]), sum(srv.cpu_times()[:2]), me.memory_info().rss
                peak, done = [0], threading.Event()

                def sample() -> None:
                    while not done.is_set():
                        peak[0] = max(peak[0], me.memory_info().rss - rss0)
                        time.sleep(0.01)

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                t0 = time.monotonic()
                if name.startswith("s3fs"):
                    s3fs_put(root / key, local, int(name[4:]))
                elif name.startswith("window"):
                    window(root / key, local, int(name[6:]))
                elif name == "store":
                    store._put_parts(local, root / key)
                else:
                    boto(server, bucket, local, "bench/" + key, int(name[4:]))
                took.setdefault(name, []).append(time.monotonic() - t0)
                done.set()
                sampler.join()
                print("%-8s %6.2f s  client CPU %5.2f s  server CPU %5.2f s  RSS +%.0f MB" % (
                    name, took[name][-1], sum(me.cpu_times()[:2]) - cpu0, sum(srv.cpu_times()[:2]) - srv0,
                    peak[0] / 1e6), flush=True)
                server.client().delete_object(Bucket=bucket, Key="bench/" + key)
        print_load("at the end")
    anchor = next((n for n in ("boto10", "boto4") if n in took), None)
    print()
    for name in names:
        ratio = " (%.2fx %s)" % (statistics.median(took[name]) / statistics.median(took[anchor]), anchor) if anchor else ""
        print("%-8s median %.2f s%s" % (name, statistics.median(took[name]), ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
