"""Graded tests of phase 4: production training.

    python tests/test_phase4.py            grade your code in phase4_production/
    python tests/test_phase4.py -k 4_2     one exercise
    pytest tests/test_phase4.py            check the reference solutions

A test named test_4_2_... grades exercise 4.2 (see phase4_production/guidelines.md).
The tests of each exercise live in tests/phase4/test_4_<n>_<topic>.py; this file
collects them all, so one command grades the phase. Multi-rank checks run in a world
of processes (common.launch.run_world) or under real torchrun agents
(common.torchrun); the ranks return plain data and every assertion happens here,
in the parent.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # `python tests/test_phase4.py` works from anywhere
import grading  # noqa: E402

# Run as a script, hand over to pytest before importing the test modules, so that pytest
# imports them itself and rewrites their asserts into messages that show the values.
if __name__ == "__main__":
    sys.exit(grading.learner_main(__file__))

from phase4.test_4_1_checkpoint import *  # noqa: E402,F401,F403
from phase4.test_4_2_recovery import *  # noqa: E402,F401,F403
from phase4.test_4_3_elastic import *  # noqa: E402,F401,F403
from phase4.test_4_4_compression import *  # noqa: E402,F401,F403
from phase4.test_4_5_monitoring import *  # noqa: E402,F401,F403
from phase4.test_4_6_hangs import *  # noqa: E402,F401,F403
