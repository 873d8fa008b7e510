"""The sweep's sampler: each trial's draw is a function of ``sweep.seed`` and the trial's number.

Optuna's samplers keep one random stream per process, seeded once, so a sweep resumed in a new
process would start that stream again from ``sweep.seed`` and draw the finished trials' values
again. Here each trial gets its own TPE sampler, seeded from (seed, trial number). Past TPE's
startup trials the draw also depends on the finished trials' results, which TPE reads from the
study. A sweep stopped at any trial boundary and resumed therefore draws what one uninterrupted
run would have drawn, and no trial draws from another trial's stream.

Driver-only. It imports Optuna at module level, so ``shardtrain.sweep_study`` imports this module
only where it makes the study (Optuna is an optional dependency).
"""

from __future__ import annotations

import hashlib
import threading

from optuna.samplers import BaseSampler, TPESampler


def trial_seed(seed: int, number: int) -> int:
    """A 32-bit seed for trial ``number`` of a sweep seeded ``seed``: a hash, so any int seed
    works (numpy's seeds must be >= 0) and no two trials' streams are related."""
    digest = hashlib.sha256(f"shardtrain-sweep:{seed}:{number}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class TrialSeededSampler(BaseSampler):
    """TPE (Optuna's defaults), with one sampler per trial seeded by ``trial_seed``. Trials run in
    threads of the driver (``sweep.parallel_trials``), so the samplers are kept per trial under a lock."""

    def __init__(self, seed: int):
        self.seed = seed
        self._lock = threading.Lock()
        self._samplers: dict[int, TPESampler] = {}

    def _sampler(self, trial) -> TPESampler:
        with self._lock:
            if trial.number not in self._samplers:
                self._samplers[trial.number] = TPESampler(seed=trial_seed(self.seed, trial.number))
            return self._samplers[trial.number]

    def infer_relative_search_space(self, study, trial):
        return self._sampler(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._sampler(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._sampler(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self._sampler(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._sampler(trial).after_trial(study, trial, state, values)
        with self._lock:
            self._samplers.pop(trial.number, None)


__all__ = ["TrialSeededSampler", "trial_seed"]
