"""The compiled engine on the GPU: driver, memory, kernels, bound step programs, KV cache, runner and backend."""
