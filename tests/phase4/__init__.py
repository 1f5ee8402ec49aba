"""Phase 4 graded tests, one module per exercise; tests/test_phase4.py collects them."""
