import os
import signal
from pathlib import Path

# Two cores are shared by the whole suite: keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Scripts that tests start as subprocesses import the shared helpers by name, as the tests do.
_SUPPORT = str(Path(__file__).resolve().parent / "support")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SUPPORT, os.environ.get("PYTHONPATH")) if p)

# Tests interrupt the jobs and servers they start with SIGINT, as Ctrl-C would. A shell starts a
# background command (`make test &`, a CI step run with `nohup ... &`) with SIGINT ignored, and an
# ignored signal stays ignored across exec: every child would then ignore Ctrl-C, Python would not
# raise KeyboardInterrupt in it, and those tests would see a job that ran to its end. With a handler
# installed here, children start with SIGINT's default disposition, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import torch  # noqa: E402

torch.set_num_threads(1)
