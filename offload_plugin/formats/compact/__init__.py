"""CompactAdamW: 8-bit moments and the int16 remainder that makes a bf16 weight an exact fp32
master; its host kernel (``native``), its optimizer and checkpoint converters (``optimizer``),
the streamed engine's format (``streamed``, ``gpu``)."""

from offload_plugin.formats.base import Family

FAMILY = Family(
    "compact", "offload_plugin.formats.compact.streamed", "offload_plugin.CompactAdamW",
    entry_keys=("remainder", "exp_avg_absmax"), group_keys=("master",),
    load_hint="It is CompactAdamW's: load it with optimizer_cls=offload_plugin.CompactAdamW, or convert "
              "it with offload_plugin.compact_optimizer.to_adamw_state_dict.")
