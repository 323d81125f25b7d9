"""Small tensors whose host buffers lie back to back travel packed: one copy per run.

Which pairs form a run is decided on the CPU (``packed_runs``); the copies themselves need
a GPU: a run packed on the way out must land in each host buffer as separate copies would,
after the work queued on the gradients, and a run sent back must reach every parameter
without moving its version counter.
"""

import pytest
import torch

from offload_plugin.host.buffers import back_to_back
from offload_plugin.host.transfer import PACK_MAX_BYTES, Transfers, packed_runs
from reference_twin import CUDA


def _block(sizes, dtype=torch.bfloat16):
    return list(torch.arange(sum(sizes)).to(dtype).split(sizes))


def test_back_to_back_views_of_one_block_make_one_span():
    views = _block([3, 5, 0, 8])
    span = back_to_back(views)
    assert span is not None and span.numel() == 16 and span.data_ptr() == views[0].data_ptr()
    assert back_to_back([views[0], views[3]]) is None  # a gap
    assert back_to_back([views[1], views[0]]) is None  # out of order
    other = torch.empty(100, dtype=torch.bfloat16)
    assert back_to_back([views[0], other]) is None  # another storage
    assert back_to_back([torch.empty(4, 4)[:, :2]]) is None  # not contiguous


def test_runs_hold_small_neighbours_and_leave_the_rest_alone():
    host = _block([4, 4, 4, 4, 4])
    big = torch.empty(PACK_MAX_BYTES // 2 + 1, dtype=torch.bfloat16)  # over the limit in bytes
    dev = [torch.empty(4, dtype=torch.bfloat16) for _ in range(5)]
    pairs = [(host[0], dev[0]), (host[1], dev[1]), (big, torch.empty_like(big)),
             (host[2], dev[2]), (host[4], dev[4]),  # host[3] skipped: a gap
             (host[3], dev[3])]
    cache = {}
    for _ in range(2):  # worked out, then from the cache
        runs = packed_runs(pairs, 0, cache)
        shapes = [(len(run), span is not None) for run, span in runs]
        assert shapes == [(2, True), (1, False), (1, False), (1, False), (1, False)], shapes
        assert [p for run, _ in runs for p in run] == pairs  # issue order kept
        assert len(cache) == 1
    # The split depends on the host side only: a device tensor of another dtype or layout
    # stays in its run (the multi-tensor copies land it as copy_ would: see the GPU test).
    for other in (dev[0].float(), torch.empty(8, dtype=torch.bfloat16)[::2]):
        assert [len(run) for run, _ in packed_runs([(host[0], other), pairs[1]], 0, cache)] == [2]
    assert [len(run) for run, _ in packed_runs(pairs[:2], 0, cache)] == [2]
    strided = torch.empty(4, 2, dtype=torch.bfloat16).t()  # a host tensor not contiguous: alone
    assert [len(run) for run, _ in packed_runs([(host[0], dev[0]), (strided, strided.clone())], host=0)] == [1, 1]
    # The other direction: the host tensor is the second of each pair.
    runs = packed_runs([(d, h) for h, d in pairs[:2]], host=1)
    assert len(runs) == 1 and runs[0][1].numel() == 8


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_runs_on_the_gpu_land_as_separate_copies_would(dtype):
    """Gradients out (after work queued on them), weights back (version counters kept)."""
    sizes = [1, 7, 4096, 64, 100_003, 3]
    transfers = Transfers(torch.device("cuda"))
    host = list(torch.zeros(sum(sizes), dtype=dtype).pin_memory().split(sizes))
    grads = [torch.randn(n, device="cuda").to(dtype) for n in sizes]
    want = [(g * 3).cpu() for g in grads]
    torch.cuda._sleep(100_000_000)  # the copy must wait for the multiply queued after this
    for g in grads:
        g.mul_(3)
    Transfers.wait(transfers.to_host(list(zip(grads, host))))
    for h, w in zip(host, want):
        assert torch.equal(h, w)
    params = [torch.nn.Parameter(torch.zeros(n, device="cuda", dtype=dtype)) for n in sizes]
    versions = [p._version for p in params]
    for h in host:
        h.add_(1)
    transfers.order_compute_after(transfers.to_device([(h, p) for h, p in zip(host, params)]))
    for p, h, v in zip(params, host, versions):
        assert torch.equal(p.detach().cpu(), h) and p._version == v


@CUDA
def test_on_the_gpu_strides_and_dtypes_land_as_copy_would():
    """A device tensor that is not contiguous, or of another dtype, beside packable
    neighbours lands element for element as ``copy_`` would put it."""
    transfers = Transfers(torch.device("cuda"))
    flat = list(torch.zeros(4 * 64, dtype=torch.bfloat16).pin_memory().split(64))
    host = [flat[0].view(8, 8), flat[1], flat[2], flat[3]]  # shaped as their parameters
    grads = [torch.randn(8, 8, device="cuda").to(torch.bfloat16).t(),  # strided
             torch.randn(64, device="cuda"),  # fp32 into a bf16 buffer: rounded as copy_ rounds
             torch.randn(64, device="cuda").to(torch.bfloat16),
             torch.randn(64, device="cuda").to(torch.bfloat16)]
    want = [torch.empty_like(h).copy_(g.cpu()) for g, h in zip(grads, host)]
    Transfers.wait(transfers.to_host(list(zip(grads, host)), runs_cache={}))
    for h, w in zip(host, want):
        assert torch.equal(h, w)
    params = [torch.nn.Parameter(torch.zeros(8, 8, device="cuda", dtype=torch.bfloat16).t()),
              torch.nn.Parameter(torch.zeros(64, device="cuda")),
              torch.nn.Parameter(torch.zeros(64, device="cuda", dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.zeros(64, device="cuda", dtype=torch.bfloat16))]
    transfers.order_compute_after(transfers.to_device(list(zip(host, params)), runs_cache={}))
    for p, h in zip(params, host):
        assert torch.equal(p.detach().cpu(), h.to(p.dtype))
