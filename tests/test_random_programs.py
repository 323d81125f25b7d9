"""Property: any sequence of what a user may do between and around steps leaves the weights
and the state bit for bit where torch's AdamW(fused=True) leaves them.

A program is a list of operations, each applied to two twins: the model under
CPUOffloadOptimizer and a deep copy under torch's fused AdamW. Training steps (accumulation,
torchtune's scaling by 1/tokens, clipping, both zero_grad flavours), weights edited in
place or loaded, lr changed, state read, edited in place, replaced, saved and loaded back,
step counts edited, and torch's own state dict loaded into ours; gradients cleared by the
model as Hugging Face's Trainer clears them. Four ways the update can
run: the host update (what CPU parameters get), the streamed update's CPU twin (the default
on a GPU, ``streamed.config.on_cpu``), offloaded gradients (with our recipes' overlapped schedule
among the operations) and half the update kept on the device (``device_fraction``). And the
same under torchtune's ``optimizer_in_bwd`` (one optimizer per parameter, in gradient hooks).
"""

import contextlib
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.engines import streamed
from reference_twin import batch, make_model, trainable

LR = 1e-2

# Operations on both twins whatever steps them (one optimizer, or one per parameter).
SHARED = [
    st.tuples(st.just("edit weight"), st.integers(0, 3), st.sampled_from([0.5, -1.0, 0.0])),
    st.tuples(st.just("load weights"), st.integers(0, 5)),
    st.tuples(st.just("lr"), st.sampled_from([0.0, 1e-3, 3e-2])),
    st.tuples(st.just("hyperparameter"), st.sampled_from(["weight_decay", "betas", "eps", "maximize"]),
              st.integers(0, 1)),
    st.tuples(st.just("save and load")),
    st.tuples(st.just("load torch's state")),
    st.tuples(st.just("edit moment"), st.integers(0, 3), st.sampled_from(["exp_avg", "exp_avg_sq"]),
              st.sampled_from([0.5, 2.0])),
    st.tuples(st.just("replace moment"), st.integers(0, 3), st.sampled_from(["exp_avg", "exp_avg_sq"])),
    st.tuples(st.just("edit step"), st.integers(0, 3), st.sampled_from([1.0, 7.0, 100.0])),
    st.tuples(st.just("fused off")),
]
OPERATIONS = st.one_of(
    st.tuples(st.just("train"), st.integers(1, 3), st.booleans(), st.sampled_from([None, 0.05, 1e3]),
              st.booleans(), st.sampled_from([False, False, True])),
    *SHARED,
    st.tuples(st.just("zero_grad kept, step")),
    st.tuples(st.just("train, cleared by the model"), st.integers(1, 2), st.sampled_from([None, 0.05]),
              st.sampled_from(["model.zero_grad()", "model.zero_grad(set_to_none=False)", "p.grad = None"])),
    st.tuples(st.just("load ours into torch")),
    st.tuples(st.just("write .data, reload"), st.integers(0, 3)),
    st.tuples(st.just("add a group")),
    st.tuples(st.just("GradScaler step"), st.sampled_from([256.0, 3.0])),
    st.tuples(st.just("train overlapped"), st.integers(1, 3), st.sampled_from([None, 0.05]), st.booleans(),
              st.sampled_from([False, False, True])),
)
IN_BACKWARD_OPERATIONS = st.one_of(st.tuples(st.just("train")), *SHARED)
HYPERPARAMETERS = {"weight_decay": [0.0, 0.3], "betas": [(0.8, 0.99), (0.0, 0.5)], "eps": [1e-6, 1e-3],
                   "maximize": [True, False]}


def _poisoned(model, poison: bool):
    """With ``poison``, the next backward gives the last layer's weight a NaN gradient."""
    if not poison:
        return contextlib.nullcontext()
    return model[4].weight.register_hook(lambda g: g * float("nan"))  # (removed on exit)


def _skip_nonfinite(opt, per_parameter: bool) -> bool:
    """The twin's stand-in for ours' nonfinite_grads="skip": a step with a non-finite
    gradient updates nothing (True: skip the step), or, where each update checks its own
    gradient, leaves that parameter alone (its gradient dropped before the step)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    bad = [p for p in params if not bool(torch.isfinite(p.grad).all())]
    if per_parameter:
        for p in bad:
            p.grad = None
        return False
    return bool(bad)


def _train(model, opt, ours: bool, step: int, accum: int, via_optimizer: bool, clip, set_to_none: bool,
           poison: bool = False):
    """torchtune's order: backward per micro-batch, scale by 1/count, clip, step, zero_grad."""
    from torchtune.training import scale_grads

    dtype = next(model.parameters()).dtype
    count = 0
    for micro in range(accum):
        x, y = batch(step, micro, "cpu", dtype)
        with _poisoned(model, poison and micro == accum - 1):
            ((model(x) - y) ** 2).sum().backward()
        count += x.shape[0] * 3  # (not a power of two: the factor rounds)
    factor = 1 / torch.tensor(count)
    if ours and via_optimizer:
        opt.scale_grads(factor)
        if clip is not None:
            opt.clip_grad_norm_(clip)
    else:
        scale_grads(model, factor)
        if clip is not None:
            # Ours sums the norms in param_groups order (it has no other), so where the twin
            # stands for it, torch's clip takes that order: the norm of the norms depends on
            # their order in its last bit (the first layer added as a second group).
            order = model.parameters() if not via_optimizer else (
                p for group in opt.param_groups for p in group["params"])
            torch.nn.utils.clip_grad_norm_(order, clip)
    if ours or not _skip_nonfinite(opt, per_parameter=False):
        opt.step()
    opt.zero_grad(set_to_none=set_to_none)


def _train_overlapped_twin(model, opt, step: int, accum: int, clip, poison: bool, per_parameter: bool):
    """What ours' overlapped step does, in torchtune's order with torch's optimizer."""
    from torchtune.training import scale_grads

    for micro in range(accum):
        x, y = batch(step, micro, "cpu", next(model.parameters()).dtype)
        with _poisoned(model, poison and micro == accum - 1):
            ((model(x) - y) ** 2).sum().backward()
    scale_grads(model, 1 / torch.tensor(3 * x.shape[0] * accum))
    if clip is not None:
        torch.nn.utils.clip_grad_norm_((p for g in opt.param_groups for p in g["params"]), clip)
    if not _skip_nonfinite(opt, per_parameter):
        opt.step()
    opt.zero_grad()


def _apply_shared(op, ref_model, ref_optims: list, model, optims: list) -> None:
    """One of the SHARED operations on both twins, each with its optimizers (one, or one
    per parameter as under optimizer_in_bwd)."""
    kind, twins = op[0], ((ref_model, ref_optims), (model, optims))
    every = ref_optims + optims
    if kind == "edit weight":
        with torch.no_grad():
            for m, _ in twins:
                trainable(m)[op[1]].mul_(op[2])
    elif kind == "load weights":
        new = make_model(dtype=next(model.parameters()).dtype, seed=op[1] + 1).state_dict()
        for m, _ in twins:
            m.load_state_dict(new)
    elif kind in ("lr", "hyperparameter", "fused off"):
        for group in (g for o in every for g in o.param_groups):
            if kind == "lr":
                group["lr"] = op[1]
            elif kind == "hyperparameter":
                group[op[1]] = HYPERPARAMETERS[op[1]][op[2]]
            else:  # torch's AdamW goes on with its for-loop; ours says so and follows
                group["fused"], group["foreach"] = False, False
    elif kind == "save and load":
        for o in every:
            o.load_state_dict(copy.deepcopy(o.state_dict()))
    elif kind == "load torch's state":
        for r, o in zip(ref_optims, optims):
            o.load_state_dict(copy.deepcopy(r.state_dict()))
    else:  # one parameter's state: a moment edited in place or replaced, or its step count
        key = "step" if kind == "edit step" else op[2]
        for m, opts in twins:
            p = trainable(m)[op[1]]
            o = next(o for o in opts if any(q is p for g in o.param_groups for q in g["params"]))
            if p not in o.state or key not in o.state[p]:
                return  # (no state before its first step: nothing to edit in either)
            state = o.state[p]
            if kind == "edit moment":
                state[key].mul_(op[3])
            elif kind == "replace moment":
                state[key] = state[key] * 2
            else:
                state[key].fill_(op[2])


def _apply(op, twins, step: int, offload_gradients: bool, streaming: bool) -> None:
    (ref_model, ref), (model, opt) = twins
    kind = op[0]
    if kind == "train":
        _, accum, via_optimizer, clip, set_to_none, poison = op
        # (Offloaded gradients too: torchtune's scale_grads and torch's clip reach them as .grad.)
        _train(ref_model, ref, False, step, accum, via_optimizer, clip, set_to_none, poison)
        _train(model, opt, True, step, accum, via_optimizer, clip, set_to_none, poison)
    elif kind == "train overlapped":  # our recipes' schedule: the update starts during backward
        if not offload_gradients:
            return  # (overlap_next_step needs offloaded gradients)
        _, accum, clip, early, poison = op
        dtype = next(model.parameters()).dtype
        # (Without clipping each update starts as its gradient lands and checks it alone.)
        _train_overlapped_twin(ref_model, ref, step, accum, clip, poison, per_parameter=clip is None)
        for micro in range(accum):
            x, y = batch(step, micro, "cpu", dtype)
            if micro == accum - 1:  # (the same 1/count as _train's)
                opt.overlap_next_step(grad_scale=1 / torch.tensor(3 * x.shape[0] * accum),
                                      clipping=clip is not None, early_forward=early)
            with _poisoned(model, poison and micro == accum - 1):
                ((model(x) - y) ** 2).sum().backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        opt.finish_step()  # (a step that returned early: the weights are read next)
    elif kind == "train, cleared by the model":  # Hugging Face's Trainer's way
        _, accum, clip, clear = op
        for m, o in twins:
            for micro in range(accum):
                x, y = batch(step, micro, "cpu", next(m.parameters()).dtype)
                (((m(x) - y) ** 2).mean() / accum).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            o.step()
            if clear == "p.grad = None":
                for p in m.parameters():
                    p.grad = None
            else:
                m.zero_grad(set_to_none=clear == "model.zero_grad()")
    elif kind == "zero_grad kept, step":
        for o in (ref, opt):
            o.zero_grad(set_to_none=False)
            o.step()
    elif kind == "load ours into torch":
        ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif kind == "write .data, reload":
        for m in (ref_model, model):
            trainable(m)[op[1]].data.mul_(0.25)  # (invisible to version counters: hence reload)
        opt.reload_weights()
    elif kind == "add a group":
        if len(ref.param_groups) > 1:
            return  # (the first layer only once)
        for m, o in twins:
            m[0].requires_grad_(True)
            o.add_param_group({"params": list(m[0].parameters()), "lr": LR / 2})
    elif kind == "GradScaler step":
        if not ref.param_groups[0]["fused"]:
            return  # (torch's AdamW built fused then set otherwise refuses GradScaler's scale)
        if op[1] != 256.0 and not streaming:
            # The host update has GradScaler unscale the gradients (x 1/scale) where torch's
            # fused kernel divides by the scale (README): the same bits for its scales, powers
            # of two, but not for others. The streamed update hands the scale to the kernel.
            return
        for m, o in twins:
            scaler = torch.amp.GradScaler("cpu", init_scale=op[1])
            x, y = batch(step, 0, "cpu", next(m.parameters()).dtype)
            scaler.scale(((m(x) - y) ** 2).mean()).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    else:
        _apply_shared(op, ref_model, [ref], model, [opt])


def _assert_same(ref_model, ref_optims: list, model, optims: list, where: str) -> None:
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name} after {where}"
    for ref, opt in zip(ref_optims, optims):
        ours, theirs = opt.state_dict(), ref.state_dict()
        # The streamed update makes a parameter's state when it plans the step, before the
        # verdict: a first step skipped for a non-finite gradient leaves step 0 and zero
        # moments, which is what torch's AdamW makes at its first step (no entry yet there).
        for index in ours["state"].keys() - theirs["state"].keys():
            entry = ours["state"][index]
            assert float(entry["step"]) == 0 and not any(bool(entry[k].any()) for k in ("exp_avg", "exp_avg_sq")), where
            del ours["state"][index]
        assert ours["state"].keys() == theirs["state"].keys(), where
        for index, entry in theirs["state"].items():
            for key, value in entry.items():
                mine = ours["state"][index][key].reshape(value.shape).to(value.dtype)
                assert torch.equal(mine, value), f"state {index} {key} after {where}"
        assert [g["lr"] for g in ours["param_groups"]] == [g["lr"] for g in theirs["param_groups"]], where


@contextlib.contextmanager
def _streamed_on_cpu(enabled: bool):
    """The streamed update's CPU twin, 32x32 weights cut in ranges (a multiple of the CPU
    kernel's vector width: its scalar tail rounds differently, CUDA's does not)."""
    saved = streamed.config.on_cpu, streamed.config.stage_numel
    streamed.config.on_cpu, streamed.config.stage_numel = enabled, 640
    try:
        yield
    finally:
        streamed.config.on_cpu, streamed.config.stage_numel = saved


@pytest.mark.parametrize("mode", ["host", "streamed", "offload_gradients", "device_fraction"])
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(OPERATIONS, min_size=1, max_size=8),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_program_leaves_what_torchs_fused_adamw_leaves(mode, program, dtype):
    with _streamed_on_cpu(mode == "streamed"):
        ref_model = make_model(dtype=dtype)
        model = copy.deepcopy(ref_model)
        ref = torch.optim.AdamW(trainable(ref_model), lr=LR, weight_decay=0.1, fused=True)
        opt = CPUOffloadOptimizer(model.parameters(), lr=LR, weight_decay=0.1,
                                  offload_gradients=mode == "offload_gradients",
                                  device_fraction=0.5 if mode == "device_fraction" else 0.0)
        for step, op in enumerate(program):
            _apply(op, ((ref_model, ref), (model, opt)), step, mode == "offload_gradients", mode == "streamed")
            _assert_same(ref_model, [ref], model, [opt], f"{program[:step + 1]}")


@pytest.mark.parametrize("mode", ["host", "streamed", "offload_gradients"])
@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(IN_BACKWARD_OPERATIONS, min_size=1, max_size=8),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_program_under_optimizer_in_bwd_leaves_what_torchs_leaves(mode, program, dtype):
    """One optimizer per parameter, stepped in its gradient hook (torchtune's
    register_optim_in_bwd_hooks, as its stock full configs set)."""
    from torchtune import training

    with _streamed_on_cpu(mode == "streamed"):
        ref_model = make_model(dtype=dtype)
        model = copy.deepcopy(ref_model)
        ref_optims = {p: torch.optim.AdamW([p], lr=LR, weight_decay=0.1, fused=True) for p in trainable(ref_model)}
        optims = {p: CPUOffloadOptimizer([p], lr=LR, weight_decay=0.1, offload_gradients=mode == "offload_gradients")
                  for p in trainable(model)}
        training.register_optim_in_bwd_hooks(ref_model, ref_optims)
        training.register_optim_in_bwd_hooks(model, optims)
        for step, op in enumerate(program):
            if op[0] == "train":
                for m in (ref_model, model):
                    x, y = batch(step, 0, "cpu", dtype)
                    ((m(x) - y) ** 2).mean().backward()
            else:
                _apply_shared(op, ref_model, list(ref_optims.values()), model, list(optims.values()))
            _assert_same(ref_model, list(ref_optims.values()), model, list(optims.values()),
                         f"{program[:step + 1]}")
