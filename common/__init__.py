"""Shared infrastructure every phase uses; not an exercise."""
