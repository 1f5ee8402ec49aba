"""The bubble stretches the compute only: the tp and cp collectives run inside every pipeline stage's work, so the pipeline idles around them too."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_step_time_terms"]
EDITS = {
    "step_time": [
        ("    terms[\"bubble\"] = (terms[\"compute\"] + terms[\"tp\"] + terms[\"cp\"]) * f / (1 - f)\n",
         "    terms[\"bubble\"] = terms[\"compute\"] * f / (1 - f)\n"),
    ],
}
