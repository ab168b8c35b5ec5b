import os

# Two cores are shared by the whole suite: keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
