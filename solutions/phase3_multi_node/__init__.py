"""Phase 3: multi-node data parallelism from scratch: ring, buckets, hierarchy, parameter servers."""
