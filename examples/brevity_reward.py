"""A complete custom reward for llmrl: a plain function, no class needed.

    llmrl train --config configs/brevity.yaml      # the README's command (task, prompts and settings there)

Each line of the prompts file is {"prompt": ..., "keyword": ...}; fields other than `prompt` and
`system` reach the function as keyword arguments.
"""


def reward(prompt: str, completion: str, keyword: str = "", **meta) -> float | None:
    """1 if the completion mentions `keyword`, plus up to 0.5 for brevity; None if it is empty
    (llmrl scores None as 0 and counts it as `reward/unscored`)."""
    text = completion.strip()
    if not text:
        return None
    mentions = float(keyword.lower() in text.lower())
    brevity = 0.5 * max(0.0, 1 - len(text.split()) / 20)
    return mentions + brevity
