"""Phase 3 graded tests, one module per exercise; tests/test_phase3.py collects them."""
