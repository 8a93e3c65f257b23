"""Custom kernels, each used only where it is built and where it measured faster."""
