"""AdamW8bit: bitsandbytes' 8-bit block-wise state, updated on the host (``native``, with the
torch reference in ``update``) or streamed through the GPU (``streamed``, ``gpu``)."""

from offload_plugin.formats.base import Family

FAMILY = Family(
    "adamw8bit", "offload_plugin.formats.adamw8bit.streamed", "offload_plugin.AdamW8bit",
    entry_keys=("__bnb_optimizer_quant_state__", "state1"), group_keys=("stochastic_rounding", "optim_bits"),
    load_hint="It is bitsandbytes' 8-bit layout (bitsandbytes' AdamW8bit, or ours): it loads exactly into "
              "optimizer_cls=offload_plugin.AdamW8bit (into CompactAdamW within a quantization step).")
