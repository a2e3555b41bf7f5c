"""The names of the files and folders a run directory holds (one place: trainer, logger, report)."""

CONFIG = "config.yaml"  # the resolved config
DATA_REPORT = "data_report.json"  # math_hard: problems kept and dropped, by reason
METRICS = "metrics.jsonl"  # one object per RL step and per eval
SAMPLES = "samples.jsonl"  # training completions, appended
EVAL_SAMPLES = "eval_samples.jsonl"  # eval completions, appended
CHECKPOINTS = "checkpoints"  # step_NNNNNN/ folders and the `latest` pointer
REPORT = "report.html"
PLOTS = "plots"
TENSORBOARD = "tensorboard"

RUN_FILES = (CONFIG, DATA_REPORT, METRICS, SAMPLES, EVAL_SAMPLES, CHECKPOINTS, REPORT, PLOTS, TENSORBOARD)
