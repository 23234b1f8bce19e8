"""The declarative runner: compose a Hydra config, train section by section, log, checkpoint.

    python -m runner                                      # resnet on digits, ~1.5 min on 2 CPU cores
    python -m runner model=resnet sections=4 batch=7500
    python -m runner -m batch=256,512 sections=1,2,4      # a sweep: outputs/multirun/<date>/<time>/<job>/
    python -m runner -m hydra/launcher=joblib hydra.launcher.n_jobs=2 batch=256,512   # jobs in parallel processes
    python -m runner -m hydra/launcher=slurm ...          # SLURM, after `pip install hydra-submitit-launcher`
    python -m runner resume=outputs/<date>/<time>         # continue that run, in its folder, from its own config
    .venv/bin/tensorboard --logdir outputs               # the command each run prints at its end

Importing this package is cheap; TensorFlow loads only when a run starts.
"""
