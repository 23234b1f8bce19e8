"""Step progress: a tqdm bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import ExitStack

from sections.rules import human_bytes

log = logging.getLogger("runner")


def _columns() -> int:
    """The terminal's width (0 where it reports none: a bar would draw nothing, so log lines instead)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


class Progress:
    """`mode`: bar, log, or auto (a bar when stderr is a terminal)."""

    def __init__(self, total: int, start: int, mode: str, log_every: int):
        self.total, self.log_every = total, log_every
        self.bar = None
        self._stack = ExitStack()
        if mode == "bar" or (mode == "auto" and sys.stderr.isatty() and _columns() > 0):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._stack.enter_context(logging_redirect_tqdm())
            self.bar = self._stack.enter_context(tqdm(total=total, initial=start, unit="step", dynamic_ncols=True))

    def update(self, step: int, loss: float, examples_per_second: float, peak_bytes: int | None) -> None:
        peak = human_bytes(peak_bytes) if peak_bytes is not None else "not measured"
        if self.bar is not None:
            self.bar.set_postfix({"loss": f"{loss:.4f}", "ex/s": f"{examples_per_second:.0f}", "peak": peak},
                                 refresh=False)
            self.bar.update(1)
        elif step % self.log_every == 0 or step == self.total:
            log.info(f"step {step}/{self.total}  loss {loss:.4f}  {examples_per_second:.0f} ex/s  peak {peak}")

    def write(self, line: str) -> None:
        """A line between bar updates (the bar redraws below it)."""
        log.info(line)

    def close(self) -> None:
        self._stack.close()
