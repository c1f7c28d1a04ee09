"""Codegen stage: turns a ModelSpec + target arch into specialised CUDA sources, cubins and a manifest."""
