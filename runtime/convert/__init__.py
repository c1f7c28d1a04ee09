"""Checkpoint -> weights artifact: the kernels' layouts, the repack plan, its serial and parallel writers, the
artifact."""
