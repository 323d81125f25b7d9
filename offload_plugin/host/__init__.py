"""The host side: page-locked buffers, the worker thread, transfers, gradients and the update of host state."""
