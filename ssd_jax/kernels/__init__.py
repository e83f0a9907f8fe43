"""ssd-jax's own compiled kernels (XLA FFI handlers), used where XLA's are the bottleneck."""
