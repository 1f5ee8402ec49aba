"""Phase 1 graded tests, one module per exercise; tests/test_phase1.py collects them."""
