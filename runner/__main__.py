"""`python -m runner [overrides]`: see `runner.app`."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from runner.app import main  # noqa: E402

if __name__ == "__main__":
    main()
