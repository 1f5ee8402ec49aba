"""The SIGTERM handler saves a checkpoint at once and exits: it runs in the middle of a step, so the file holds a half-done step (the dropout draws of the step already taken, the update not yet)."""
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of  # noqa: F401

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_sigterm_saves_at_next_step_boundary"]


def run_resumable(train_step, model, optimizer, checkpoints, *, total_steps, every, scheduler=None, scaler=None,
                  injector=None, signals=(signal.SIGTERM,), map_location=None, extra_progress=None, on_resume=None):
    attempt = current_attempt()
    injector = injector or FaultInjector()
    progress = resume(checkpoints, model, optimizer, scheduler, scaler, map_location)
    if progress is not None and on_resume is not None:
        on_resume(progress)
    start = done = int(progress["step"]) if progress is not None else 0
    set_aside_newer(checkpoints, start if progress is not None else None)

    def save_and_exit(signum, frame):  # the bug: save right here, mid-step, and leave
        state = training_state(model, optimizer, scheduler, scaler, {"step": done})
        checkpoints.save(done, state)
        raise SystemExit(0)

    previous = {sig: signal.signal(sig, save_and_exit) for sig in signals}
    try:
        while done < total_steps:
            injector.begin_step(done)
            train_step(StepContext(done, attempt, injector.point))
            done += 1
            if done % every == 0 or done == total_steps:
                state = training_state(model, optimizer, scheduler, scaler, {"step": done})
                with injector.saving():
                    checkpoints.save(done, state)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return RunOutcome(start, done, False, attempt)
