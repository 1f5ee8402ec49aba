"""Graded tests of phase 2: advanced training on one node.

    python tests/test_phase2.py            grade your code in phase2_advanced/
    python tests/test_phase2.py -k 2_4     one exercise
    pytest tests/test_phase2.py            check the reference solutions

A test named test_2_4_... grades exercise 2.4 (see phase2_advanced/guidelines.md).
The tests of each exercise live in tests/phase2/test_2_<n>_<topic>.py; this file
collects them all, so one command grades the phase. Multi-rank checks run in a world
of processes (common.launch.run_world); the ranks return plain data and every
assertion happens here, in the parent.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # `python tests/test_phase2.py` works from anywhere
import grading  # noqa: E402

# Run as a script, hand over to pytest before importing the test modules, so that pytest
# imports them itself and rewrites their asserts into messages that show the values.
if __name__ == "__main__":
    sys.exit(grading.learner_main(__file__))

from phase2.test_2_1_accumulation import *  # noqa: E402,F401,F403
from phase2.test_2_2_mixed_precision import *  # noqa: E402,F401,F403
from phase2.test_2_3_checkpointing import *  # noqa: E402,F401,F403
from phase2.test_2_4_zero import *  # noqa: E402,F401,F403
from phase2.test_2_5_model_split import *  # noqa: E402,F401,F403
from phase2.test_2_6_pipeline import *  # noqa: E402,F401,F403
from phase2.test_2_7_tensor_parallel import *  # noqa: E402,F401,F403
from phase2.test_2_8_mesh import *  # noqa: E402,F401,F403
from phase2.test_2_9_context_parallel import *  # noqa: E402,F401,F403
from phase2.test_2_10_moe import *  # noqa: E402,F401,F403
from phase2.test_2_11_parallel_3d import *  # noqa: E402,F401,F403
from phase2.test_2_12_planner import *  # noqa: E402,F401,F403
