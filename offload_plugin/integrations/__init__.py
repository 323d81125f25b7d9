"""Adapters for training frameworks that build their optimizers themselves.

Each submodule imports its framework and is imported only by its users (``import
offload_plugin`` imports none of them): ``offload_plugin.integrations.torchtitan``.
"""
