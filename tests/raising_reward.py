"""A reward function for tests that raises on most completions (all but those of a length divisible by 4)."""


def reward(prompt, completion, **meta):
    if len(completion) % 4:
        raise ValueError(f"cannot grade {completion[:20]!r}")
    return 1.0
