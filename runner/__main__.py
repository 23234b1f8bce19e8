"""`python -m runner [overrides]`: see `runner.app`."""

import contextlib
import faulthandler
import io
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# A crash in a kernel (oneDNN's under an emulated device's limit, say) prints the Python stack it came from.
faulthandler.enable()

from sections.allocator import configure  # noqa: E402  (plain Python: TensorFlow is not loaded yet)

configure()  # memory statistics on every CPU: must happen before TensorFlow loads

from runner.app import CONF, main  # noqa: E402
from runner.config.overrides import check_overrides  # noqa: E402
from runner.config.resume import resume_arguments  # noqa: E402
from runner.errors import ConfigError, full_errors  # noqa: E402
from runner.help import cut_names_section, help_args, shown_help, wants_help  # noqa: E402

if __name__ == "__main__":
    try:
        sys.argv[1:] = resume_arguments(sys.argv[1:])
        check_overrides(sys.argv[1:], CONF)
    except ConfigError as err:
        if full_errors():
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if wants_help(sys.argv[1:]):
        kept, dropped = help_args(sys.argv[1:])
        sys.argv[1:] = kept
        if dropped:
            print(f"(--help shows one run's config: sweep values left out: {' '.join(dropped)})", flush=True)
        code, printed = 0, io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                main()  # Hydra prints its help (and exits)
        except SystemExit as done:
            code = done.code
        print(shown_help(printed.getvalue()), end="", flush=True)
        section = cut_names_section(sys.argv[1:], CONF) if not code else None
        if section:
            print(section, flush=True)
        sys.exit(code)
    main()
