import os
from pathlib import Path

# Two cores are shared by the whole suite: keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Scripts that tests start as subprocesses import the shared helpers by name, as the tests do.
_SUPPORT = str(Path(__file__).resolve().parent / "support")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SUPPORT, os.environ.get("PYTHONPATH")) if p)

import torch  # noqa: E402

torch.set_num_threads(1)
