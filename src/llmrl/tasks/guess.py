"""guess: find a secret integer from 1 to 10 in at most 5 guesses, told "higher" or "lower" after each.

A guess is <guess>N</guess> or a reply that is only a number; the chat history holds one finished
game (the protocol). Reward: 1.0 − 0.1·(guesses − 1) when found ("solved"), plus 0.2 × the share of
replies that are a valid guess ("format"); max 1.2.
"""

from __future__ import annotations

import random
import re

from llmrl.tasks.base import Example, Reward, SeededSampling
from llmrl.tasks.env import Environment, Episode, Turn

LOW, HIGH = 1, 10
SYSTEM = (f"We play a guessing game. I think of an integer from {LOW} to {HIGH}. Reply with only your guess as "
          "<guess>NUMBER</guess>. After each guess I say whether my number is higher or lower.")
USER = "I have a new number. Make your first guess."
GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>|^\s*(-?\d+)\s*\.?\s*$")  # tagged, or a reply that is only a number
SHOTS = [  # one finished game in the chat history: the protocol
    {"role": "user", "content": "I have a number. Make your first guess."},
    {"role": "assistant", "content": "<guess>5</guess>"},
    {"role": "user", "content": "Higher."},
    {"role": "assistant", "content": "<guess>8</guess>"},
    {"role": "user", "content": "Lower."},
    {"role": "assistant", "content": "<guess>7</guess>"},
    {"role": "user", "content": "Correct!"},
]
EVAL_SEED_OFFSET = 777


class GuessEnv(SeededSampling, Environment):
    name = "guess"
    eval_n_default = 30
    max_turns = 5

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.eval_seed = seed + EVAL_SEED_OFFSET

    @staticmethod
    def example(secret: int) -> Example:
        return Example(messages=[{"role": "system", "content": SYSTEM}, *SHOTS, {"role": "user", "content": USER}],
                       answer=secret)

    def sample_train_batch(self, n: int) -> list[Example]:
        return [self.example(self.rng.randint(LOW, HIGH)) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        rng = random.Random(self.eval_seed)
        return [self.example(rng.randint(LOW, HIGH)) for _ in range(n)]

    def start(self, episode: Episode) -> None:
        episode.state = {"valid": 0, "solved": False}

    def step(self, episode: Episode, reply: str) -> Turn:
        m = GUESS.search(reply)
        if not m:
            return Turn(None)  # not a guess: the game ends
        episode.state["valid"] += 1
        guess, secret = int(m.group(1) or m.group(2)), episode.example.answer
        if guess == secret:
            episode.state["solved"] = True
            return Turn(None)
        return Turn([{"role": "user", "content": "Higher." if secret > guess else "Lower."}])

    def reward(self, episode: Episode) -> Reward:
        s = episode.state
        components = {"solved": (1.0 - 0.1 * (episode.replies - 1)) if s["solved"] else 0.0,
                      "format": 0.2 * s["valid"] / max(episode.replies, 1)}
        return Reward(total=sum(components.values()), components=components)

    def correct(self, episode: Episode) -> bool:
        return bool(episode.state["solved"])

    def evaluate(self, episodes: list[Episode]) -> dict[str, float]:
        n = max(len(episodes), 1)
        return {"solved": sum(ep.state["solved"] for ep in episodes) / n,
                "turns": sum(ep.replies for ep in episodes) / n,
                "valid": sum(ep.state["valid"] / max(ep.replies, 1) for ep in episodes) / n}
