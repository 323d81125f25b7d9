"""offload_plugin.formats.inner: the inner optimizer's contract is read from its class and checked once."""

import pytest
import torch

from offload_plugin import CompactAdamW
from offload_plugin.formats import inner


def test_torch_optimizers_declare_nothing():
    c = inner.contract(torch.optim.AdamW)
    assert (c.bf16_host_only, c.state_format, c.scales_gradients_in_step, c.optional_group_keys) == (False, None, False, ())
    assert c.hooks == frozenset()
    assert c.hook(torch.optim.AdamW([torch.zeros(1)]), "weight_replaced") is None


def test_compact_adamw_declares_its_traits_and_hooks():
    c = inner.contract(CompactAdamW)
    assert (c.bf16_host_only, c.state_format, c.scales_gradients_in_step) == (True, "compact", True)
    assert set(c.optional_group_keys) == {"master", "min_8bit_size"}
    assert c.hooks == set(inner.HOOKS)
    opt = CompactAdamW([torch.zeros(4, dtype=torch.bfloat16)])
    assert c.hook(opt, "weight_replaced") == opt.weight_replaced
    assert inner.contract(CompactAdamW) is c  # (checked once)


def _cls(**attrs):
    return type("Custom", (torch.optim.SGD,), attrs)


def test_a_subclass_of_the_contract_offers_only_the_hooks_it_defines():
    cls = type("Custom", (torch.optim.SGD, inner.InnerOptimizer),
               {"shard_of": lambda self, p, full_shape: None})
    assert inner.contract(cls).hooks == {"shard_of"}


@pytest.mark.parametrize("attrs, message", [
    (dict(_is_offload_optimizer=True), "cannot be CPUOffloadOptimizer itself"),
    (dict(bf16_host_only="yes"), "bf16_host_only must be True or False"),
    (dict(scales_gradients_in_step=1), "scales_gradients_in_step must be True or False"),
    (dict(optional_group_keys="master"), "optional_group_keys must be a tuple"),
    (dict(optional_group_keys=(1,)), "optional_group_keys must be a tuple"),
    (dict(scales_gradients_in_step=True), "its step\\(\\) takes no grad_scale"),
    (dict(state_format="nope"), "unknown state_format 'nope'"),
    (dict(state_format="compact"), "needs the hooks \\['before_update', 'check_state_entry'"),
    (dict(weight_replaced=lambda self: None), "weight_replaced must take \\(self, p, weight\\)"),
    (dict(check_state_entry=lambda self, where, entry: None), "check_state_entry must take"),
])
def test_a_class_that_breaks_the_contract_is_refused(attrs, message):
    with pytest.raises(TypeError, match=message):
        inner.contract(_cls(**attrs))


def test_hooks_with_defaults_or_extra_optional_arguments_are_accepted():
    cls = _cls(weight_replaced=lambda self, p, weight=None, *, why=None: None,
               step=lambda self, closure=None, grad_scale=None: None, scales_gradients_in_step=True)
    c = inner.contract(cls)
    assert c.hooks == {"weight_replaced"} and c.scales_gradients_in_step


def test_the_contract_is_checked_when_the_class_is_given():
    from offload_plugin import CPUOffloadOptimizer
    from offload_plugin.options import resolve_optimizer_cls

    bad = _cls(bf16_host_only="yes")
    with pytest.raises(TypeError, match="bf16_host_only must be True or False"):
        resolve_optimizer_cls(bad)
    with pytest.raises(TypeError, match="bf16_host_only must be True or False"):
        CPUOffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], optimizer_cls=bad)
    with pytest.raises(TypeError, match="cannot be CPUOffloadOptimizer itself"):
        resolve_optimizer_cls("offload_plugin.CPUOffloadOptimizer")
    assert resolve_optimizer_cls("offload_plugin.CompactAdamW") is CompactAdamW
