"""torch's Adam(W) state (moments in the dtype of the tensor updated, fp32 masters where asked):
its host kernels (``kernels``, ``native``) and the streamed engine's format (``streamed``)."""

from offload_plugin.formats.base import Family

FAMILY = Family("adamw", "offload_plugin.formats.adamw.streamed")
