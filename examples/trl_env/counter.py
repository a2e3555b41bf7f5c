"""A TRL `environment_factory` class, written as TRL's docs show them: llmrl runs it unchanged.

    llmrl train --environment_factory examples/trl_env/counter.py:CounterEnv \
        --dataset examples/trl_env/rows.jsonl --chat_template chatml-tools --model smollm2-135m-instruct

One instance per episode; `reset(**row)` gets the dataset row's fields; every public method but reset and
get_reward is a tool whose JSON schema comes from its type hints and docstring.
"""


class CounterEnv:
    def __init__(self):
        self.counter = 0
        self.target = 0

    def reset(self, target: int = 0, **kwargs) -> str | None:
        self.counter = 0
        self.target = int(target)
        return None  # nothing to add to the prompt

    def increment(self, amount: int) -> int:
        """
        Add an amount to the counter.

        Args:
            amount: How much to add (may be negative).

        Returns:
            The counter's new value.
        """
        self.counter += int(amount)
        return self.counter

    def read_counter(self) -> int:
        """
        Read the counter.

        Returns:
            The counter's value.
        """
        return self.counter

    def get_reward(self) -> float:
        return 1.0 if self.counter == self.target else 0.0
