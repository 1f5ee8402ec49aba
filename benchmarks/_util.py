"""What every benchmark script shares: one-line flag errors and an optional matplotlib."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line (no usage block) and exits with code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def pyplot_or_none():
    """matplotlib.pyplot on a file-only backend, or None (with an install hint) if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: pip install matplotlib (or pip install -e '.[plot]')")
        return None
    return plt
