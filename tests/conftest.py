"""The tests run CPU parameters through the host worker's thread, as GPU users' parameters
run (CI has no GPU); by default parameters on the CPU update in the training thread
instead (offload_plugin.host.process). Tests of that path take the ``cpu_inline`` fixture;
tests that start their own processes (recipes, the README's commands) get it too, but
the FSDP2 ranks of test_dtensor.py, which stand in for GPU ranks, and one variant of each
test_exit.py case set the host thread themselves."""

import pytest
import torch.distributed as dist

from offload_plugin.host import process


@pytest.fixture(autouse=True)
def _host_thread_on_cpu(monkeypatch):
    monkeypatch.setattr(process, "_INLINE_ON_CPU", False)


@pytest.fixture
def cpu_inline(monkeypatch):
    """Parameters on the CPU update in the calling thread, as outside the tests."""
    monkeypatch.setattr(process, "_INLINE_ON_CPU", True)


def pytest_collection_modifyitems(items):
    """The ``gpu`` marker on every test named for the GPU (``-k "cuda or gpu"``, the
    selection .ci/gpu-checks runs), so that ``-m gpu`` and ``-m "not gpu"`` select the same."""
    for item in items:
        name = item.nodeid.lower()  # (file, test and parameter names, as -k reads them)
        if "gpu" in name or "cuda" in name:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one rank (gloo) and its CPU mesh, for DTensor parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
