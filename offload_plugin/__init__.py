"""offload_plugin: a torchtune plugin that keeps the optimizer in host memory.

Use ``offload_plugin.CPUOffloadOptimizer`` as ``optimizer._component_`` in a torchtune config.

The package's rooms: ``optimizer`` (the facade) and ``options`` (what each combination of
options does) at the top; ``engines/`` (where and when each update runs); ``host/`` (the host
side: buffers, worker, transfers, gradients); ``checkpoint/``; ``formats/`` (each family of
optimizer state in its own folder, found through ``formats.registry``); ``integrations/``.
"""

import importlib
import logging
import sys

from offload_plugin.checkpoint.torchao import convert_torchao_state_dict
from offload_plugin.formats.adamw8bit.optimizer import AdamW8bit
from offload_plugin.formats.compact.optimizer import CompactAdamW
from offload_plugin.host.grad_handle import OffloadedGrad
from offload_plugin.host.memory import HostMemoryError
from offload_plugin.host.worker import HostUpdateError
from offload_plugin.optimizer import CPUOffloadOptimizer
from offload_plugin.optimizer_in_backward import OptimizerInBackward

__all__ = ["CPUOffloadOptimizer", "AdamW8bit", "CompactAdamW", "HostMemoryError", "HostUpdateError", "OffloadedGrad", "OptimizerInBackward",
           "convert_torchao_state_dict"]

# The modules that defined the public names before the package had folders: their import
# paths (offload_plugin.adamw8bit.AdamW8bit, offload_plugin.compact_optimizer.to_adamw_state_dict,
# ...) keep working as names of the modules that define them now.
_EARLIER_PATHS = {"adamw8bit": "formats.adamw8bit.optimizer", "compact_optimizer": "formats.compact.optimizer",
                  "checkpoint_compat": "checkpoint.torchao", "grad_handle": "host.grad_handle",
                  "host_memory": "host.memory", "host_worker": "host.worker"}
for _old, _new in _EARLIER_PATHS.items():
    sys.modules[f"{__name__}.{_old}"] = globals()[_old] = importlib.import_module(f"{__name__}.{_new}")

# Like torchtune's own logger: show our INFO lines (what was kept, where the update runs)
# unless the application has configured logging for us.
_logger = logging.getLogger(__name__)
if not _logger.handlers:
    _logger.addHandler(logging.StreamHandler())
    _logger.setLevel(logging.INFO)
