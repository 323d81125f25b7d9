"""What issuing one batch of weight copies to the GPU costs the calling thread.

The host update thread sends each batch of updated weights with ``Transfers.to_device``
while the training thread runs Python to launch kernels. This times the call (not the
copy) for batches of --pieces copies totalling --mib MiB from pinned huge-page memory:
through the CUDA runtime with the GIL held (``runtime``, the default) and through torch's
``copy_`` (``torch``), with the rest of the process idle and beside a thread launching
small kernels in a loop (``busy_neighbour``).

    python bench/investigations/copy_issue_cost.py --json out.json
"""

import argparse
import datetime
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from offload_plugin.host.buffers import _huge_page_block, _pin
from offload_plugin.host.transfer import Transfers

MIB = 1 << 20


def _launch_until(stop: threading.Event, device) -> None:
    """A training thread's forward, roughly: many small kernels, launched from Python."""
    x = torch.zeros(1024, device=device)
    while not stop.is_set():
        for _ in range(200):
            x.add_(1)
        torch.cuda.current_stream(device).synchronize()


def median_issue_us(transfers, block, dst, mib, pieces, reps) -> float:
    per = mib * MIB // block.element_size() // pieces
    after = transfers.mark_compute()
    times = []
    for _ in range(reps):
        pairs = [(block[i * per:(i + 1) * per], dst[i * per:(i + 1) * per]) for i in range(pieces)]
        start = time.perf_counter()
        event = transfers.to_device(pairs, after=after)
        times.append(time.perf_counter() - start)
        event.synchronize()
    return statistics.median(times) * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", default="1,32,128", help="batch sizes in MiB, comma-separated")
    p.add_argument("--pieces", default="1,4", help="copies per batch, comma-separated")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sizes = [int(m) for m in args.mib.split(",")]
    pieces = [int(n) for n in args.pieces.split(",")]
    device = torch.device("cuda", torch.cuda.current_device())
    block = _huge_page_block(max(sizes) * MIB // 2, torch.bfloat16)
    if not _pin(block):
        raise SystemExit("could not pin the host block")
    dst = torch.empty_like(block, device=device)
    paths = {"runtime": Transfers(device), "torch": Transfers(device)}
    if paths["runtime"]._runtime is None:
        raise SystemExit("torch's CUDA runtime library was not found: nothing to compare")
    paths["torch"]._runtime = None
    rows = []
    for neighbour in ("idle", "busy_neighbour"):
        stop = threading.Event()
        thread = threading.Thread(target=_launch_until, args=(stop, device))
        if neighbour == "busy_neighbour":
            thread.start()
            time.sleep(0.2)
        for path, transfers in paths.items():
            for mib in sizes:
                for n in pieces:
                    us = median_issue_us(transfers, block, dst, mib, n, args.reps)
                    rows.append(dict(neighbour=neighbour, path=path, mib=mib, pieces=n,
                                     median_us=round(us, 1)))
                    print(f"{neighbour:15} {path:8} {mib:4} MiB in {n} copies: {us:7.1f} us",
                          flush=True)
        stop.set()
        if thread.is_alive():
            thread.join()
    result = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(device),
                  torch=torch.__version__, reps=args.reps, results=rows)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
