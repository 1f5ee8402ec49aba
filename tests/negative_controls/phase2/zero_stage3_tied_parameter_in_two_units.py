"""ZeRO-3 lays out each child's parameters without looking for ones another child shares: a tied weight is
flattened into two units, the second takes it over, and the first unit's forward finds it freed (or stale)."""

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_tied_and_frozen_parameters_stage3"]
EDITS = {  # ZeroStage3 takes its units from this sharding_units: it is the module's
    "sharding_units": [
        ("        for p in params:\n"
         "            if p in owner:\n"
         "                raise ValueError(f\"ZeRO stage 3: a parameter of `{name}` is also one of `{owner[p]}` (tied weights); \"\n"
         "                                 \"put every user of a shared parameter under one child module\")\n"
         "            owner[p] = name\n", ""),
    ],
}
