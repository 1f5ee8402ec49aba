"""Graded tests of phase 1: data parallelism on one node.

    python tests/test_phase1.py            grade your code in phase1_data_parallel/
    python tests/test_phase1.py -k 1_2     one exercise
    pytest tests/test_phase1.py            check the reference solutions

A test named test_1_2_... grades exercise 1.2 (see phase1_data_parallel/guidelines.md).
The tests of each exercise live in tests/phase1/test_1_<n>_<topic>.py; this file
collects them all, so one command grades the phase. Multi-rank checks run in a world
of processes (common.launch.run_world); the ranks return plain data and every
assertion happens here, in the parent.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # `python tests/test_phase1.py` works from anywhere
import grading  # noqa: E402

# Run as a script, hand over to pytest before importing the test modules, so that pytest
# imports them itself and rewrites their asserts into messages that show the values.
if __name__ == "__main__":
    sys.exit(grading.learner_main(__file__))

from phase1.test_1_1_sampler import *  # noqa: E402,F401,F403
from phase1.test_1_2_allreduce import *  # noqa: E402,F401,F403
from phase1.test_1_3_comm_bench import *  # noqa: E402,F401,F403
from phase1.test_1_4_trainer import *  # noqa: E402,F401,F403
