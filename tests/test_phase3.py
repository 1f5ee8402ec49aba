"""Graded tests of phase 3: multi-node data parallelism.

    python tests/test_phase3.py            grade your code in phase3_multi_node/
    python tests/test_phase3.py -k 3_2     one exercise
    pytest tests/test_phase3.py            check the reference solutions

A test named test_3_2_... grades exercise 3.2 (see phase3_multi_node/guidelines.md).
The tests of each exercise live in tests/phase3/test_3_<n>_<topic>.py; this file
collects them all, so one command grades the phase. Multi-rank checks run in a world
of processes (common.launch.run_world); the ranks return plain data and every
assertion happens here, in the parent.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # `python tests/test_phase3.py` works from anywhere
import grading  # noqa: E402

# Run as a script, hand over to pytest before importing the test modules, so that pytest
# imports them itself and rewrites their asserts into messages that show the values.
if __name__ == "__main__":
    sys.exit(grading.learner_main(__file__))

from phase3.test_3_1_ring import *  # noqa: E402,F401,F403
from phase3.test_3_2_bucketed_ddp import *  # noqa: E402,F401,F403
from phase3.test_3_3_hierarchical import *  # noqa: E402,F401,F403
from phase3.test_3_4_parameter_server import *  # noqa: E402,F401,F403
from phase3.test_3_5_distributed_optimizer import *  # noqa: E402,F401,F403
