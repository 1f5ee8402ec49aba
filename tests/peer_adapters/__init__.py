"""Thin adapters that let other courses' test suites run against this course's code (see each file)."""
