"""The process's global random number generators (Python's `random`, NumPy's, torch's CPU and CUDA ones)."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


@contextlib.contextmanager
def kept_rng_state():
    """Restore Python's, NumPy's and torch's global RNG states (CPU and CUDA) on exit: code run inside (vLLM, an
    environment library that reseeds them) cannot move the trainer's streams, so a resumed run stays exact."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
