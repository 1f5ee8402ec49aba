"""capture_rng keeps numpy's key array and position but not the Gaussian it holds back (has_gauss, cached_gaussian): after an odd number of normal draws the resumed noise differs from the uninterrupted run's."""

EXERCISE = "4.1"
CAUGHT_BY = ['test_4_1_resume_is_bit_exact']
EDITS = {
    "capture_rng": [
        ('"has_gauss": int(has_gauss), "cached_gaussian": float(cached)}',
         '"has_gauss": 0, "cached_gaussian": 0.0}'),
    ],
}
