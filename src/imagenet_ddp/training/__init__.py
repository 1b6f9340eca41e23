"""The training stage, one file per concern (a newcomer finds each piece by its name):

- :mod:`.config`: a run's settings (:class:`~.config.TrainConfig`) and the job's geometry;
- :mod:`.accuracy`: top-1/top-5 counted once across ranks (evaluate reuses it);
- :mod:`.model`: the model factory and the ``model.pt`` file (one writer, one reader);
- :mod:`.recipe`: optimizer, learning-rate schedule, loss, augmentation, EMA;
- :mod:`.data`: per-sample seeded augmentation, the resumable sampler, the loader;
- :mod:`.checkpoint`: where checkpoints live, saving, finding and resuming;
- :mod:`.state`: one rank's training state (:class:`~.state.TrainingState`);
- :mod:`.loop`: the step loop and what happens at each epoch's end;
- :mod:`.metrics`: throughput, progress lines and the run's metrics files;
- :mod:`.worker`: one rank's entry point (``python -m imagenet_ddp.training.worker``).

Nothing is imported here. The published recipes are settings (settings/presets.py).
"""
