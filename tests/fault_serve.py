"""Test support (not a test module): `python tests/fault_serve.py serve ARGS...` runs `thorgen serve ARGS...` with
tests/device_fault.py's hook installed: POST /test/device-fault makes the next engine step launch a kernel that
traps. Only a server started through this script has that route; `thorgen serve` itself never does. The hook goes
where the engine runs: this process, or the engine process the server starts (multiprocessing's spawn runs this
file there as `__mp_main__`, before the engine opens its backend), where it obeys the server's arming."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import device_fault  # noqa: E402
from thorgen.cli import main  # noqa: E402
from thorgen.serve import app as serve_app  # noqa: E402

_create_app = serve_app.create_app

if __name__ == "__mp_main__":  # the engine process (runtime/process) of the server this file started
    device_fault.install(os.getppid())


def create_app(*args, **kwargs):
    """The server's own app, plus the route that arms the fault."""
    app = _create_app(*args, **kwargs)
    device_fault.add_route(app)
    return app


if __name__ == "__main__":
    device_fault.install()
    serve_app.create_app = create_app  # (serve/cli.py imports it when the command runs)
    main()
