"""Contract of exercise 4.2 (recovery.py's docstrings; guidelines 4.2): resuming, preemption, fault injection and the
resumable loop under torchrun."""

import signal

from contracts import default, none, raises, value, when


CONTRACT = {
    "current_attempt": [when("no process group", lambda c: c.world == 1), when("in a world", lambda c: c.world > 1)],
    "resume": [
        when("nothing to resume (None)", lambda c: c.result is None),
        when("a checkpoint resumed", lambda c: c.result is not None),
        none("scheduler"), none("scaler"), default("map_location"),
        when("in a world (rank 0's step for all)", lambda c: c.world > 1),
    ],
    "set_aside_newer": [none("resumed"), when("resumed a step", lambda c: c.a["resumed"] is not None),
                        when("nothing newer", lambda c: c.result == [])],
    "PreemptionHandler.__init__": [default("signals"), when("several signals", lambda c: len(c.a["signals"]) > 1),
                                   none("device")],
    "PreemptionHandler.__enter__": [when("called", lambda c: True)],
    "PreemptionHandler.__exit__": [when("on an exception", lambda c: c.a["exc"] and c.a["exc"][0] is not None)],
    "PreemptionHandler.should_stop": [when("in a world", lambda c: c.world > 1), when("one process", lambda c: c.world == 1)],
    "Fault.parse": [when("with attempt and action", lambda c: "attempt=" in c.a["text"] and "action=" in c.a["text"]),
                    when("step '*' (every step)", lambda c: "step=*" in c.a["text"]),
                    raises("a malformed spec", ValueError)],
    "FaultInjector.__init__": [default("faults")],
    "FaultInjector.from_string": [when("empty (no faults)", lambda c: c.a["spec"] == ""),
                                  when("several faults", lambda c: ";" in c.a["spec"])],
    "FaultInjector.from_env": [when("called", lambda c: True)],
    "FaultInjector.begin_step": [when("called", lambda c: True)],
    "FaultInjector.point": [when("called", lambda c: True)],
    "FaultInjector.allreduce_hook": [when("called by DDP", lambda c: True)],
    "FaultInjector.saving": [none("step"), when("step given (a writer thread)", lambda c: c.a["step"] is not None)],
    "run_resumable": [
        when("a fresh start", lambda c: c.result.start_step == 0),
        when("a resume", lambda c: c.result.start_step > 0),
        when("a finished run (nothing to do)", lambda c: c.result.start_step >= c.a["total_steps"]),
        when("preempted", lambda c: c.result.preempted),
        none("injector"), none("extra_progress"), none("on_resume"), none("scheduler"), none("scaler"),
        when("every = 1", lambda c: c.a["every"] == 1),
        when("total_steps not a multiple of every", lambda c: c.a["total_steps"] % c.a["every"] != 0),
    ],
}

IRRELEVANT = {
    "current_attempt: in a world": "reached through run_resumable, which the torchrun tests run in worlds of 2 "
        "(every attempt reads it afresh); the one-process case is tested directly",
    "Fault.parse": "given code (no EXERCISE region): the fault-injection harness, not part of recovery",
    "FaultInjector.__init__": "given code (no EXERCISE region): the fault-injection harness", "FaultInjector.from_string": "given code (no EXERCISE region): the harness",
    "FaultInjector.allreduce_hook": "given code (no EXERCISE region): the harness", "FaultInjector.begin_step": "given code (no EXERCISE region): the harness",
    "FaultInjector.point": "given code (no EXERCISE region): the harness", "FaultInjector.saving": "given code (no EXERCISE region): the harness",
    "FaultInjector.from_env": "given code (no EXERCISE region): the harness",
    "PreemptionHandler.__init__: device not None": "needs a GPU device (CI has none): the flag travels as a tensor on it",
}
