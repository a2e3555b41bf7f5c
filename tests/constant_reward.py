"""A reward function for tests: every completion scores 0.3 (not exact in binary floating point)."""


def reward(prompt, completion, **meta):
    return 0.3
