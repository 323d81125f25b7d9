"""Property: any constructor arguments and param-group layout either train exactly like the
reference torch optimizer over the same trainable parameters, or raise a clear error."""

import math

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from offload_plugin import CPUOffloadOptimizer
from reference_twin import reference, train, twins

OPTIMIZERS = {
    "AdamW": torch.optim.AdamW,
    "Adam": torch.optim.Adam,
    "SGD": torch.optim.SGD,
    "RMSprop": torch.optim.RMSprop,
    "Adagrad": torch.optim.Adagrad,
}
HYPERPARAMETERS = {  # name -> values, valid and invalid, that the classes may accept or refuse
    "lr": st.sampled_from([1e-3, 1e-2, 0.0, -1e-3, math.nan]),
    "weight_decay": st.sampled_from([0.0, 0.1, -0.5]),
    "betas": st.sampled_from([(0.9, 0.999), (0.8, 0.9), (1.5, 0.9), (0.9, -0.1)]),
    "momentum": st.sampled_from([0.0, 0.9, -0.2]),
    "eps": st.sampled_from([1e-8, 1e-6, -1.0]),
    "fused": st.sampled_from([True, False]),
}


@st.composite
def layouts(draw):
    """Param groups over the model's 6 tensors: any split, some frozen, some repeated."""
    n_groups = draw(st.integers(1, 3))
    assignment = draw(st.lists(st.integers(0, n_groups - 1), min_size=6, max_size=6))
    frozen = draw(st.lists(st.booleans(), min_size=6, max_size=6))
    repeat = draw(st.sampled_from([None, 0, 3]))  # a tensor given twice
    group_lrs = draw(st.lists(st.sampled_from([None, 5e-3, -1.0]), min_size=n_groups, max_size=n_groups))
    return n_groups, assignment, frozen, repeat, group_lrs


def _groups(model, layout):
    n_groups, assignment, frozen, repeat, group_lrs = layout
    params = list(model.parameters())
    for p, f in zip(params, frozen):
        p.requires_grad_(not f)
    groups = [{"params": [p for p, g in zip(params, assignment) if g == i]} for i in range(n_groups)]
    for group, lr in zip(groups, group_lrs):
        if lr is not None:
            group["lr"] = lr
    if repeat is not None:
        groups[assignment[repeat]]["params"].append(params[repeat])
    return groups


def _trainable_only(groups):
    return [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in groups]


def _build(factory):
    try:
        return factory(), None
    except (ValueError, TypeError, RuntimeError) as err:
        return None, err


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(list(OPTIMIZERS)),
    kwargs=st.fixed_dictionaries({}, optional=HYPERPARAMETERS),
    layout=layouts(),
    offload_gradients=st.booleans(),
    master_weights=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_behaves_like_reference_or_raises_clearly(
    name, kwargs, layout, offload_gradients, master_weights, dtype
):
    cls = OPTIMIZERS[name]
    ref_model, model = twins(dtype=dtype)
    # fp32 reference for master weights; same dtype without them.
    ref_model = ref_model.float() if master_weights else ref_model
    ours, our_error = _build(lambda: CPUOffloadOptimizer(
        _groups(model, layout), optimizer_cls=cls, offload_gradients=offload_gradients,
        master_weights=master_weights, **kwargs))
    ref, ref_error = _build(lambda: reference(cls, _trainable_only(_groups(ref_model, layout)), **kwargs))

    event("both refused" if our_error and ref_error else "we refused" if our_error
          else "torch refused" if ref_error else "both trained")
    if our_error is not None:
        assert str(our_error), "an error must say what is wrong"
        n_trainable = sum(not f for f in layout[2])
        stricter = (
            layout[3] is not None and not layout[2][layout[3]]  # a trainable tensor twice
            or n_trainable == 0  # nothing to optimize: we raise, torch accepts empty groups
        )
        assert ref_error is not None or stricter, f"refused what torch accepts: {our_error!r}"
        return
    assert ref_error is None or "duplicate" in str(ref_error), f"accepted what torch refuses: {ref_error!r}"
    if ref is None:
        return
    losses, _ = train(model, ours, 2, via_optimizer=True)
    ref_losses, _ = train(ref_model, ref, 2) if dtype == torch.float32 or not master_weights else (None, None)
    if ref_losses is None:
        return  # bf16 with masters has no exact torch twin; covered by the bf16 tests
    if not all(math.isfinite(loss) for loss in ref_losses + losses):
        # (lr=nan) A step with an inf/NaN gradient is skipped here by design
        # (nonfinite_grads="skip", tested in test_reliability); torch applies it.
        event("non-finite: skipped here, applied by torch")
        return
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
