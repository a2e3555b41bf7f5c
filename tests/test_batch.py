"""The step's typed counts (llmrl/batch.py): merged over ranks and rounds, then logged as rollout/ metrics."""

from llmrl.batch import Counts, DynamicCounts, EpisodeCounts, LagCounts, merge


def test_merge_sums_takes_maxima_and_keeps_absent_parts_absent():
    a = Counts(prompts_skipped=1, prompts_truncated=2, reward_errors=0,
               episodes=EpisodeCounts(episodes=3, turns=4, turns_max=2, env_tokens=10, env_abandoned=1),
               lag=LagCounts(lag_sum=3, rows=3, lag_max=1))
    b = Counts(prompts_skipped=0, prompts_truncated=1, reward_errors=2,
               episodes=EpisodeCounts(episodes=4, turns=6, turns_max=3, env_tokens=5, env_abandoned=0, cut_max_turns=1),
               lag=LagCounts(lag_sum=0, rows=4, lag_max=0))
    m = merge(a, b)
    assert (m.prompts_skipped, m.prompts_truncated, m.reward_errors) == (1, 3, 2)
    assert m.episodes == EpisodeCounts(episodes=7, turns=10, turns_max=3, env_tokens=15, env_abandoned=1, cut_max_turns=1)
    assert m.dynamic is None and m.lag == LagCounts(lag_sum=3, rows=7, lag_max=1)
    logged = m.logged()
    # means per episode over both parts (10/7 and 15/7 are not exact in binary: compared as the same division)
    assert logged["turns"] == 10 / 7 and logged["env_tokens"] == 15 / 7 and logged["turns_max"] == 3
    assert logged["cut_max_turns"] == 1 and logged["env_abandoned"] == 1
    assert logged["policy_lag"] == 3 / 7 and logged["policy_lag_max"] == 1
    assert "sampling_rounds" not in logged and "prompts_skipped" not in logged and "reward_errors" not in logged
    # merging with nothing changes nothing; merging is the same in either order
    assert merge(Counts(), a) == a and merge(b, a) == m


def test_single_turn_counts_log_only_what_applies():
    c = merge(Counts(prompts_truncated=1), Counts(dynamic=DynamicCounts(2, 1, 0)))
    assert c.logged() == {"prompts_truncated": 1, "sampling_rounds": 2, "groups_flat_dropped": 1, "groups_flat_kept": 0}
