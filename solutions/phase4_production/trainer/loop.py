"""One attempt of the phase-4 trainer on one rank: build, then the loop (or a read-only mode).

    python -m solutions.phase4_production.train                       # 2 CPU ranks, digits
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 -m solutions.phase4_production.train
    torchrun ... -m solutions.phase4_production.train --config imagenet_resnet50_8gpu.toml

    train(cfg)         the output folder claimed (one writer, every node sees it: run_folder.py),
                       stop signals recorded (4.2), the flight record started (flight.py); then
                       build (build.py: data, model, strategy, optimizer, checkpointer, evaluator,
                       report; resumed from the newest checkpoint that verifies), then
    train_loop(run)    for each step: the batch, the step (forward, backward: the strategy
                       reduces, optimizer), then at its boundary, in this order:
                         the registered per-step work          the --model-ema average
                         the ranks' agreement on a stop signal  every --stop-check-every steps
                         the loss read back, if logged or saved
                         the epoch's evaluation                 at an epoch's end
                         the report: times, stragglers, metrics
                         a checkpoint                           every N steps, epoch end, stop, end
                         a stop: saved, every rank told, leave
                       then the summary (final results, the weights' fingerprint)
    or modes.py        --benchmark-loader, --export, --evaluate: functions over the built run

Nothing is read back from the device on a step that is not logged, saved or evaluated: loss,
step times and the stop flag wait (sync.py). What makes a resumed run bit-identical to one
never stopped (CPU, same world size): the checkpoint holds model, optimizer, LR schedule, loss
scaler, data position and every rank's RNG (and the EMA); the data order depends on (seed,
epoch) only; each sample's augmentation on (seed, epoch, index, copy) only
(data.SeededSamples); batch mixing on (seed, step) only (device_stage.BatchMixing). With
--compression a run resumes correctly but not bit-identically (see comm.register_comm_hook).
The command line is cli.py.
"""

from __future__ import annotations

import contextlib

from common.distributed import current_device
from solutions.phase4_production.recovery import PreemptionHandler
from solutions.phase4_production.trainer.build import Run, begin_attempt, build
from solutions.phase4_production.trainer.config import TrainConfig
from solutions.phase4_production.trainer.data import build_inputs
from solutions.phase4_production.trainer.flight import FlightRecord
from solutions.phase4_production.trainer.lifecycle import stop_signals
from solutions.phase4_production.trainer.modes import benchmark_loader, evaluate_only, export_weights
from solutions.phase4_production.trainer.run_folder import claim_output_dir

BEFORE = "before the first step"


def train(cfg: TrainConfig) -> dict:
    """Train (or resume, or find finished) the run in --output-dir on this rank, or run the
    read-only mode cfg asks for; returns the summary (on every rank). Collective: every rank of
    the process group calls it. A stop signal (SIGTERM, SIGINT) is recorded from the first line
    on: the run stops and saves at the next step boundary, however early it came."""
    device = current_device()
    flight = FlightRecord(cfg.faults.pg_init_timeout)  # building data, model and the first step may be slow
    folder = contextlib.nullcontext() if cfg.read_only else claim_output_dir(cfg.run.output_dir, device)
    with PreemptionHandler(stop_signals(), device=device) as preemption, folder:
        with flight.waiting("a collective", at=BEFORE):
            attempt, started = begin_attempt(cfg)
            inputs = build_inputs(cfg.data, cfg.run.seed, device, attempt.rank, attempt.world_size, flight)
        if cfg.run.benchmark_loader is not None:
            return benchmark_loader(inputs, cfg.run.benchmark_loader, device, attempt.world_size, flight)
        with flight.waiting("a collective", at=BEFORE):
            run = build(cfg, inputs, attempt, device, preemption, flight, started)
        if cfg.run.export is not None:
            return export_weights(run)
        if cfg.run.evaluate:
            return evaluate_only(run)
        return train_loop(run)


def train_loop(run: Run) -> dict:
    """Train from run.start to run.end (module docstring); the summary."""
    with run.flight.waiting("a collective", at=BEFORE):
        run.start_training()
    cfg, step, stopped = run.cfg, run.start, False
    run.evaluator.catch_up(step)  # the epoch-end evaluation a preemption skipped
    with run.profiler as prof, run.checkpointer:
        while step < run.end and not stopped:
            batches = iter(run.inputs.train)
            while step < run.end:
                batch = run.stepper.next_batch(batches, step)
                if batch is None:
                    break  # the epoch's batches are done
                run.stepper.step(batch, step)
                step += 1
                run.after_step(step)
                epoch_done, last = run.inputs.sampler.consumed == 0, step == run.end
                # before the evaluation: the grace period is ticking. A host collective, no device sync
                stop = run.stop.should_stop(step, due=epoch_done or last)
                saving = stop or epoch_done or last or step % cfg.checkpoint.checkpoint_every == 0
                logged = step % cfg.report.log_every == 0
                loss = run.stepper.loss() if logged or saving else None
                if epoch_done and not stop:
                    run.evaluator.epoch_end(step)
                run.report.step(step, loss, run.stepper.lr, *run.stepper.times(step, logged, stop or last))
                if prof is not None:
                    prof.step()
                if saving:
                    run.checkpointer.save(step)
                if stop:
                    run.checkpointer.finish(step)  # the checkpoint is complete before anyone says so
                    stopped = True
                    break
        run.checkpointer.wait(step)  # the last checkpoint is on disk before the run says it is done
    return run.summary(step, preempted=stopped)
