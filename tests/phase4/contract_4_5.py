"""Contract of exercise 4.5 (monitoring.py's docstrings; guidelines 4.5): step timing, MFU, stragglers, metrics."""

from contracts import SIGNATURE_DEFAULT, default, none, when


CONTRACT = {
    "StepTimer.__init__": [none("device"), default("phases"), when("custom phases", lambda c: "phases" in c.given)],
    "StepTimer.mark": [when("called", lambda c: True)],
    "StepTimer.add_span": [when("a phase also entered with phase()", lambda c: "phase" in c.since("start")),
                           when("called", lambda c: True)],
    "StepTimer.start": [when("again after a stop (next step)", lambda c: "stop" in c.history)],
    "StepTimer.phase": [when("a phase entered twice in one step", lambda c: any(
        p["name"] == c.a["name"] for p in c.previous("phase")) and "stop" not in c.since("phase")),
                        when("a phase not in the list", lambda c: c.a["name"] not in c.self.phases)],
    "StepTimer.stop": [default("samples"), when("samples > 0", lambda c: c.a["samples"] > 0),
                       when("no phase entered (all 'other')", lambda c: "phase" not in c.since("start"))],
    "peak_flops": [when("a known GPU", lambda c: c.result is not None), when("an unknown name (None)", lambda c: c.result is None),
                   when("a name that must not match a shorter token (L40 vs L4)", lambda c: "L40" in c.a["device_name"]
                        or "GH200" in c.a["device_name"])],
    "mfu": [when("called", lambda c: True)],
    "training_flops": [when("a model with convolutions", lambda c: any("Conv" in type(m).__name__ for m in c.a["model"].modules())),
                       when("a model with attention", lambda c: any("Attention" in type(m).__name__
                                                                    for m in c.a["model"].modules())),
                       when("a linear model", lambda c: True)],
    "StragglerDetector.__init__": [default("every"), when("every = 1", lambda c: c.a["every"] == 1),
                                   when("min_excess_s > 0", lambda c: c.a["min_excess_s"] > 0),
                                   none("group")],
    "StragglerDetector.update": [when("a report step", lambda c: c.result is not None),
                                 when("a step without report", lambda c: c.result is None),
                                 when("a second report (window restarts)", lambda c: c.result is not None
                                      and c.count > c.self.every),
                                 when("world > 2", lambda c: c.world > 2)],
    "memory_stats": [none("device"), when("a CPU device", lambda c: c.a["device"] is not None)],
    "MetricsWriter.__init__": [none("rank"), none("tensorboard_dir"),
                               when("a '{rank}' path", lambda c: "{rank}" in str(c.a["path"]))],
    "MetricsWriter.write": [when("a 0-d tensor field", lambda c: any(getattr(v, "dim", lambda: 1)() == 0
                                                                    for v in c.a.values()))],
    "MetricsWriter.close": [when("called", lambda c: True)],
    "MetricsWriter.__enter__": [when("called", lambda c: True)],
    "MetricsWriter.__exit__": [when("called", lambda c: True)],
    "training_profiler": [default("rank"), when("repeat = 0 (until the end)", lambda c: c.a["repeat"] == 0),
                          when("repeat > 1", lambda c: c.a["repeat"] > 1), when("wait = 0", lambda c: c.a["wait"] == 0)],
}

IRRELEVANT = {
    "StepTimer.stop: samples left to its default": SIGNATURE_DEFAULT + " (0)",
    "training_profiler: rank left to its default": SIGNATURE_DEFAULT + " (0)",
    "MetricsWriter.__enter__": "given code (no EXERCISE region): the context manager around the graded write",
    "MetricsWriter.__exit__": "given code (no EXERCISE region): the context manager around the graded write",
    "MetricsWriter.__init__": "given code (no EXERCISE region): opens the file the graded write appends to",
    "StepTimer.__init__": "given code (no EXERCISE region): stores the device and the phases",
    "StepTimer.add_span": "given code (no EXERCISE region): adds a span between two marks of the graded _mark",
    "StepTimer.mark": "given code (no EXERCISE region): the public face of the graded _mark",
    "StepTimer.phase": "given code (no EXERCISE region): brackets a block with two marks",
    "StragglerDetector.__init__": "given code (no EXERCISE region): stores the settings; update's entries cover the reports",
    "training_flops": "given code (no EXERCISE region): torch's FlopCounterMode over one step",
}
