"""The phase-4 trainer's entry point: `python -m solutions.phase4_production.train [--flags]`.

    python -m solutions.phase4_production.train                       # 2 CPU ranks, digits
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 -m solutions.phase4_production.train
    torchrun ... -m solutions.phase4_production.train --config imagenet_resnet50_8gpu.toml

The trainer itself is the package trainer/ (its __init__.py maps its components); this file
only runs its command line (trainer/cli.py).
"""

import os

if __name__ == "__main__" and "RANK" not in os.environ:
    # Without torchrun this process starts the ranks, forked from a fork server: started first,
    # it imports what the ranks need (the loop, torchvision) while this process imports the
    # command line (seconds saved per run: common.launch.start_fork_server).
    from common.launch import start_fork_server

    start_fork_server([f"{__package__}.trainer.loop", "torchvision"])

from phase4_production.trainer.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
