"""run_resumable saves every `every` steps and at a preemption, but not after the last step: a run of 5 steps
saved every 2 ends with step 4 on disk, and relaunching the finished run trains step 4 again."""
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_saves_after_the_last_step"]


def run_resumable(train_step, model, optimizer, checkpoints, *, total_steps, every, scheduler=None, scaler=None,
                  injector=None, signals=(signal.SIGTERM,), map_location=None, extra_progress=None, on_resume=None):
    if every < 1 or total_steps < 0:
        raise ValueError(f"every={every}, total_steps={total_steps}")
    attempt = current_attempt()
    injector = injector or FaultInjector()
    progress = resume(checkpoints, model, optimizer, scheduler, scaler, map_location)
    if progress is not None and on_resume is not None:
        on_resume(progress)
    start = int(progress["step"]) if progress is not None else 0
    set_aside_newer(checkpoints, start if progress is not None else None)
    done = start
    with PreemptionHandler(signals, device=_device_of(model)) as preemption:
        while done < total_steps:
            injector.begin_step(done)
            train_step(StepContext(done, attempt, injector.point))
            done += 1
            stop = preemption.should_stop()
            if stop or done % every == 0:  # the bug: `or done == total_steps` forgotten
                state = training_state(model, optimizer, scheduler, scaler,
                                       {**(extra_progress() if extra_progress else {}), "step": done})
                with injector.saving():
                    checkpoints.save(done, state)
            if stop:
                if attempt.world_size > 1:
                    dist.barrier()
                return RunOutcome(start, done, True, attempt)
    return RunOutcome(start, done, False, attempt)
