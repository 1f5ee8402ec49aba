"""ZeRO-3 lays out each child's parameters without looking for ones another child shares: a tied weight is
flattened into two units, the second takes it over, and the first unit's forward finds it freed (or stale)."""
import torch.nn as nn

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_tied_and_frozen_parameters_stage3"]


def _units_without_check(model: nn.Module):
    units = [(child, [p for p in child.parameters() if p.requires_grad]) for child in model.children()]
    return [(child, params) for child, params in units if params]


_reference_init = _reference.ZeroStage3.__init__


class ZeroStage3(_reference.ZeroStage3):
    def __init__(self, model, **options):
        saved, _reference.sharding_units = _reference.sharding_units, _units_without_check
        try:
            _reference_init(self, model, **options)
        finally:
            _reference.sharding_units = saved
