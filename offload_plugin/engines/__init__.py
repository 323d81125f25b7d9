"""The engines: where and when each parameter's update runs (on the host, or streamed through the GPU)."""
