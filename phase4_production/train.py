"""The phase-4 trainer's entry point: `python -m solutions.phase4_production.train [--flags]`.

    python -m solutions.phase4_production.train                       # 2 CPU ranks, digits
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 -m solutions.phase4_production.train
    torchrun ... -m solutions.phase4_production.train --config imagenet_resnet50_8gpu.toml

The trainer itself is the package trainer/ (its __init__.py maps its components); this file
only runs its command line (trainer/cli.py).
"""

from phase4_production.trainer.cli import main

if __name__ == "__main__":
    main()
