"""run_resumable never looks for a checkpoint: every restart (and every relaunch of the same command) trains again from step 0."""
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_resumes_from_newest_valid_checkpoint"]


def run_resumable(train_step, model, optimizer, checkpoints, *, total_steps, every, scheduler=None, scaler=None,
                  injector=None, signals=(signal.SIGTERM,), map_location=None, extra_progress=None, on_resume=None):
    attempt = current_attempt()
    injector = injector or FaultInjector()
    start = done = 0  # the bug: no resume
    with PreemptionHandler(signals, device=_device_of(model)) as preemption:
        while done < total_steps:
            injector.begin_step(done)
            train_step(StepContext(done, attempt, injector.point))
            done += 1
            stop = preemption.should_stop()
            if stop or done % every == 0 or done == total_steps:
                state = training_state(model, optimizer, scheduler, scaler,
                                       {**(extra_progress() if extra_progress else {}), "step": done})
                with injector.saving():
                    checkpoints.save(done, state)
            if stop:
                if attempt.world_size > 1:
                    dist.barrier()
                return RunOutcome(start, done, True, attempt)
    return RunOutcome(start, done, False, attempt)
