from __future__ import annotations

import torch

# Two cores on CI: keep every process single-threaded (spawned ranks inherit this via fork).
torch.set_num_threads(1)
