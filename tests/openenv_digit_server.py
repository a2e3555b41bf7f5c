"""A local OpenEnv environment server for the tests: guess a digit (0-9) from its seed, told higher or lower.

    python tests/openenv_digit_server.py PORT

Reward per step: 1.0 for the digit (the episode ends), -0.1 for a reply without a digit; 3 guesses at most.
"""

import re
import sys
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str


class DigitGame(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self.target, self.guesses = 0, 0
        self._state = State(step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self.target, self.guesses = (seed or 0) % 10, 0
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="Guess my digit from 0 to 9. Reply with the digit.", reward=0.0)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self.guesses += 1
        self._state.step_count += 1
        m = re.search(r"\d", action.message)
        if m is None:
            return GuessObservation(text="No digit in that.", reward=-0.1, done=self.guesses >= 3)
        guess = int(m.group())
        if guess == self.target:
            return GuessObservation(text="Right.", reward=1.0, done=True)
        return GuessObservation(text="Higher." if guess < self.target else "Lower.", reward=0.0, done=self.guesses >= 3)

    @property
    def state(self) -> State:
        return self._state


app = create_app(DigitGame, GuessAction, GuessObservation, env_name="digit", max_concurrent_envs=64)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
