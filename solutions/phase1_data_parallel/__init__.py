"""Phase 1: data parallelism on one node."""
