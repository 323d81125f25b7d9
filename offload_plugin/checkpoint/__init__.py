"""Checkpoints: torch's state_dict layout, its checks and converters, torchao's layout."""
