"""Phase 4: production training: checkpoints, recovery, elasticity, compression, monitoring."""
