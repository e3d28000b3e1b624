"""Training runs as ``dpzoo train`` makes them: :mod:`~dpzoo.runs.classifier` (classifiers on images,
tables and texts), :mod:`~dpzoo.runs.loop` (the step loop shared with sequence models: progress,
evaluations, checkpoints, Ctrl-C, resume), :mod:`~dpzoo.runs.files` (the output directory, metrics
and checkpoint files), :mod:`~dpzoo.runs.plots` and :mod:`~dpzoo.runs.progress` (the per-step bar of
every long job).
"""
