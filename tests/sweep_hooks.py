"""A Hydra callback for tests/test_sweep_resume.py: kills a sweep at a chosen moment, deterministically.

`+hydra.callbacks.kill._target_=sweep_hooks.KillAfterCheckpoint +hydra.callbacks.kill.job=1
+hydra.callbacks.kill.marker=<file>`: when job 1 has saved its first checkpoint (and, with `wait_for`, once that
file exists: another job's status), the sweep's whole process group is killed with SIGKILL, as a node failure or
`kill -9` of the launcher would. Once only: the marker file says it happened, so the continued sweep runs on.
The test starts the sweep in a session of its own, so the group is the sweep's processes and nothing else.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


class KillAfterCheckpoint(Callback):
    def __init__(self, job: int, marker: str, wait_for: str | None = None) -> None:
        self.job, self.marker, self.wait_for = int(job), Path(marker), wait_for

    def on_job_start(self, config, **kwargs: Any) -> None:
        if config.hydra.job.num != self.job or self.marker.exists():
            return
        from runner.run.checkpoint import Checkpoints  # the job (a forked child of this process) inherits the patch

        save, marker, wait_for = Checkpoints.save, self.marker, self.wait_for

        def save_then_die(checkpoints, step: int):
            saved = save(checkpoints, step)
            if saved and not marker.exists():
                while wait_for and not Path(wait_for).exists():  # a condition another job makes true, not a time
                    time.sleep(0.05)
                marker.write_text(f"killed after the checkpoint of step {step}\n")
                os.killpg(os.getpgid(0), signal.SIGKILL)
            return saved

        Checkpoints.save = save_then_die
