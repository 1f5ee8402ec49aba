"""Measuring what distributed code does, in one place: used by tests and benchmarks,
never inside an exercise (an exercise file holds its idea, not its instruments).

Each section below serves one kind of question:
  * collectives and bytes   which collectives a rank called, with how many bytes
  * saved activations       bytes autograd keeps for backward (saved-tensor hooks)
  * tensors held            bytes of the distinct storages an object keeps alive
  * pipeline timelines      rendering a schedule's time grid
"""

from __future__ import annotations

# ------------------------------------------------------ collectives and bytes


# ---------------------------------------------------------- saved activations


# --------------------------------------------------------------- tensors held


# --------------------------------------------------------- pipeline timelines
