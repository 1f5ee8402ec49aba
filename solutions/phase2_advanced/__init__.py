"""Phase 2: advanced training on one node: memory and model parallelism."""
