"""run_resumable saves only {"step": ...}: what extra_progress() returns (the data position, say) is lost, and a resumed run re-reads or skips data."""
import signal
from typing import Any, Callable

from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of  # noqa: F401 - run_resumable's body uses it

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_extra_progress_and_on_resume"]


def run_resumable(train_step: Callable[[StepContext], None], model, optimizer, checkpoints: CheckpointManager, *,
                  total_steps: int, every: int, scheduler=None, scaler=None, injector: FaultInjector | None = None,
                  signals: tuple[int, ...] = (signal.SIGTERM,), map_location: Any = None,
                  extra_progress: Callable[[], dict] | None = None,
                  on_resume: Callable[[dict], None] | None = None) -> RunOutcome:
    """Run steps [start, total_steps) where start is the step of the newest valid checkpoint
    (0 without one), on every rank of the current process group; the same call starts a
    run, resumes it after a crash, and does nothing for a finished run. Checkpoints newer
    than the one resumed (they failed verification) are set aside (set_aside_newer) before
    the first save, so that keep-last-k keeps this run's new checkpoints.

    Checkpoints (training_state, progress {"step": steps done, **extra_progress()}) are
    saved after every `every` steps, after the last step, and at the step boundary where
    the ranks agree to stop on a signal (then the call returns with preempted=True). The
    previous signal handlers are restored on return. on_resume(progress) is called after
    loading a checkpoint (e.g. to put a sampler back at its position). Exceptions (a peer
    died inside a collective) propagate: torchrun then restarts the group.
    """
    if every < 1 or total_steps < 0:
        raise ValueError(f"every={every}, total_steps={total_steps}: need every >= 1 and total_steps >= 0")
    attempt = current_attempt()
    injector = injector or FaultInjector()
    device = _device_of(model)
    progress = resume(checkpoints, model, optimizer, scheduler, scaler, map_location)
    if progress is not None and on_resume is not None:
        on_resume(progress)
    start = int(progress["step"]) if progress is not None else 0
    set_aside_newer(checkpoints, start if progress is not None else None)
    done = start
    with PreemptionHandler(signals, device=device) as preemption:
        while done < total_steps:
            injector.begin_step(done)
            train_step(StepContext(done, attempt, injector.point))
            done += 1
            stop = preemption.should_stop()
            if stop or done % every == 0 or done == total_steps:
                state = training_state(model, optimizer, scheduler, scaler, {"step": done})  # the bug: no extra_progress()
                with injector.saving():
                    checkpoints.save(done, state)
            if stop:
                if attempt.world_size > 1:
                    dist.barrier()  # the file is complete before any rank reports "saved, stopping"
                return RunOutcome(start, done, True, attempt)
    return RunOutcome(start, done, False, attempt)
