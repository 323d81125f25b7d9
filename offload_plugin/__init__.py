"""offload_plugin: a torchtune plugin that keeps the optimizer in host memory.

Use ``offload_plugin.CPUOffloadOptimizer`` as ``optimizer._component_`` in a torchtune config.
"""

import logging

from offload_plugin.adamw8bit import AdamW8bit
from offload_plugin.checkpoint_compat import convert_torchao_state_dict
from offload_plugin.compact_optimizer import CompactAdamW
from offload_plugin.grad_handle import OffloadedGrad
from offload_plugin.host_memory import HostMemoryError
from offload_plugin.host_worker import HostUpdateError
from offload_plugin.optimizer import CPUOffloadOptimizer
from offload_plugin.optimizer_in_backward import OptimizerInBackward

__all__ = ["CPUOffloadOptimizer", "AdamW8bit", "CompactAdamW", "HostMemoryError", "HostUpdateError", "OffloadedGrad", "OptimizerInBackward",
           "convert_torchao_state_dict"]

# Like torchtune's own logger: show our INFO lines (what was kept, where the update runs)
# unless the application has configured logging for us.
_logger = logging.getLogger(__name__)
if not _logger.handlers:
    _logger.addHandler(logging.StreamHandler())
    _logger.setLevel(logging.INFO)
