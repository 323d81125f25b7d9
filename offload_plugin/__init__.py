"""offload_plugin: a torchtune plugin that keeps the optimizer in host memory.

Use ``offload_plugin.CPUOffloadOptimizer`` as ``optimizer._component_`` in a torchtune config.
"""

import logging

from offload_plugin.optimizer import CPUOffloadOptimizer

__all__ = ["CPUOffloadOptimizer"]

# Like torchtune's own logger: show our INFO lines (what was kept, where the update runs)
# unless the application has configured logging for us.
_logger = logging.getLogger(__name__)
if not _logger.handlers:
    _logger.addHandler(logging.StreamHandler())
    _logger.setLevel(logging.INFO)
