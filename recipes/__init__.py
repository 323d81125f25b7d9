# Recipes install as the package offload_plugin.recipes (see pyproject.toml).
