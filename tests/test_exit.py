"""A process that trained with CPUOffloadOptimizer exits with status 0 through the
interpreter's normal shutdown: one process, and both ranks of an FSDP2 (gloo) run.

Each run ends right after step(), when the optimizer's own collectives (the non-finite
verdict, the global norm) are the latest: gloo's worker thread releases a finished
collective after reporting it done, and releasing a tensor that has a Python object takes
the GIL; a thread still waiting for it when the interpreter finalizes is ended with
pthread_exit, which aborts the process ('terminate called without an active exception',
status -6). See offload_plugin/distributed.py (_RECENT_WORK). The race is narrow, so a pass
here is evidence, not proof; a failure is a real abort at exit. Each runs with the update
in the training thread (CPU parameters' default) and in the host worker's thread (as on a
GPU; see tests/conftest.py).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.slow  # (starts processes: left out of the quick lane, pytest -m "not slow")

_TRAIN = textwrap.dedent(
    """
    import sys
    import torch
    from offload_plugin import CPUOffloadOptimizer
    from offload_plugin.host import process

    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    process._INLINE_ON_CPU = sys.argv[4] == "inline"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import init_device_mesh

        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    for offload_gradients in (False, True):
        opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2, offload_gradients=offload_gradients)
        for _ in range(3):
            model(torch.randn(4, 4)).pow(2).mean().backward()
            if offload_gradients:
                opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    if world > 1:
        dist.destroy_process_group()
    print("trained", rank)
    """
)


def _launch(tmp_path, world: int, run: int, where: str) -> list:
    store = str(tmp_path / f"rendezvous{run}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [
        subprocess.Popen(
            [sys.executable, "-c", _TRAIN, str(rank), str(world), store, where],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for rank in range(world)
    ]


def _check(procs) -> None:
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=240)
        assert f"trained {rank}" in out, err
        assert "terminate called" not in err, err
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{err}"


WHERE = ["inline", "host_thread"]


@pytest.mark.parametrize("where", WHERE)
def test_single_process_exits_normally(tmp_path, where):
    _check(_launch(tmp_path, 1, 0, where))


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("where", WHERE)
def test_every_gloo_rank_exits_normally(tmp_path, where):
    """Both ranks of an FSDP2 run, each ending right after the optimizer's collectives."""
    _check(_launch(tmp_path, 2, 0, where))
