"""Reference solutions: the complete code behind every template."""
