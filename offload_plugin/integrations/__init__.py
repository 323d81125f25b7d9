"""Adapters for training frameworks that build their optimizers themselves.

Each submodule is imported only by its users (``import offload_plugin`` imports none of
them, and none imports a framework the core package would then need):
``offload_plugin.integrations.torchtitan`` (imports torchtitan), ``offload_plugin.integrations.hf``.
"""
