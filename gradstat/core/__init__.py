"""The core: exact reductions on any device (kernels, the native and Triton kernels), process
groups and DTensor placements, and which gradients count (Megatron's deduplication)."""
