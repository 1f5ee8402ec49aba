"""Phase 2 graded tests, one module per exercise; tests/test_phase2.py collects them."""
