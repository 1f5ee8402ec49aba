"""The phase-4 production trainer: an orchestrator over components, each built from its own
config section (python -m solutions.phase4_production.train; train.py one folder up).

    cli.py            flags -> config; pick the device; start the ranks or join torchrun's; the result lines
      environment.py  the variables the run reads besides its flags (torchrun's, the device's), checked first
    config.py         the sections (run, data, model, optim, parallel, checkpoint, report, faults),
                      flat flags, TOML recipes; every value checked before a process starts
    loop.py           train(cfg): claim the folder, build, then train_loop(run) or a read-only mode
    build.py          config -> Run: inputs, model, strategy, optimizer and schedule, report,
                      evaluator, checkpointer (resumed); the registration of --model-ema
    modes.py          --benchmark-loader, --export, --evaluate: functions over a built run
    data.py           build_inputs: the data pipeline's one entry point (datasets, the resumable
                      sampler, seeded samples, loaders)
      augment.py      what a loader worker does to a sample (decode, crop, flip, RandAugment, erase box)
      device_stage.py the device side: prefetch on a side stream, normalise, erase, GPU decode, MixUp/CutMix
      data_checks.py  each split's fingerprint (kept in checkpoints), test samples that are training
                      samples left out, ImageFolder's splits labelled alike
    parallel.py       the layouts as strategies behind one protocol: DDPStrategy, FSDPStrategy
      comm.py         DDP's communication hook: 4.4's compression, the fault injector's all-reduce point
    step.py           the optimizer and its schedule; train_step; the Stepper the loop calls
    evaluator.py      the test set's top-1, top-5 and loss for the model and its averages; the history
    ema.py            --model-ema: the EMA of the weights (per shard under fsdp)
    checkpointer.py   one interface: save(step), load_latest(), verify, retention; built with the
                      stateful parts
      stores.py       its two stores: FileStore (4.1's one file, rank 0) and DCPStore (shards)
      checkpoint_writer.py   the file store's background writer
      sharded_checkpoint.py  the DCP store's committed folders of shards
      resume.py       what a start resumes and refuses; --apply-changes; --init-from
    flight.py         the flight record (4.6): every wait named, a timeout said in one line
    sync.py           what the loop reads back from the device, and when; the stop agreement
    report.py         progress bar or log lines, metrics records, config files, MFU
    lifecycle.py      stop signals, dying with the launcher, errors said once per agent
    run_folder.py     the output folder: one writer, shared by every node, why a write failed

Imports go one way (tests/test_trainer_structure.py checks that no module imports one that imports
it back, and that the layout's name is read in parallel.py only):
cli -> loop -> modes -> build -> checkpointer, evaluator, data, ... -> the exercises 4.1-4.6.
"""
