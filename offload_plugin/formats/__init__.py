"""State formats: each family of optimizer state in its own folder, found through the registry."""
