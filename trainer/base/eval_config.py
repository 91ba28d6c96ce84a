"""The trainer config's `eval:` section: a held-out split of the task scored during training and by
`gke-tpu-rl eval` (trainer/rl/evaluate.py). Its own module so config.py stays one readable schema page; the section
is a field of `TrainConfig` like any other, and the reference docs walk it from there."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, model_validator

# The held-out split of a task without its own `eval_example`: example(EVAL_INDEX_OFFSET + i). No training step
# reaches these indices (TrainConfig refuses steps x prompts_per_step at or above it).
EVAL_INDEX_OFFSET = 1 << 40


class EvalConfig(BaseModel):
    """Every `every` steps (and after the last one) the policy answers `prompts` held-out prompts: once greedily, and
    `samples` times at the eval's own temperature/top_k/top_p; the scores are the mean reward of each and pass@k, the
    unbiased estimate (Chen et al. 2021) from the `samples` completions of each prompt, a completion passing when its
    `pass_reward` is at least `pass_threshold`."""

    # The settings of config._Strict (unknown keys refused, frozen: hashable like every section).
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, allow_inf_nan=False)

    every: int = Field(0, ge=0, description="evaluate after every N training steps; 0: only at the end (at_end)")
    at_end: bool = Field(True, description="evaluate after the last step (a run stopped early by a signal does not)")
    prompts: int = Field(32, gt=0, description="held-out prompts per evaluation: the task's eval_example(0..N-1), "
                         "or example(2^40 + i) for a task without one")
    greedy: bool = Field(True, description="score one greedy (temperature 0) completion per prompt")
    samples: int = Field(4, ge=0, description="sampled completions per prompt (the n of pass@k); 0: greedy only")
    # A list in the file, kept as a tuple: the section stays hashable.
    pass_at: Annotated[list[int], AfterValidator(tuple), PlainSerializer(list)] | None = Field(
        None, description="the k of each pass@k reported, each in [1, samples]; unset: 1 and samples")
    temperature: float | None = Field(None, gt=0, description="the sampled eval's temperature; unset: "
                                      "sampling.temperature (the rollouts' program is then reused)")
    top_k: int | None = Field(None, ge=0, description="the sampled eval's top-k; unset: sampling.top_k")
    top_p: float | None = Field(None, gt=0, le=1, description="the sampled eval's top-p; unset: sampling.top_p")
    pass_reward: str | None = Field(None, description="the reward a completion passes on (one of the run's "
                                    "rewards); unset: the first of them")
    pass_threshold: float = Field(1.0, description="a completion passes when its pass_reward is at least this")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description="the eval's own random stream (never the "
                             "training one's); unset: the run's seed")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of each pass@k, ascending, without repeats."""
        if self.samples == 0:
            return ()
        return tuple(sorted(set(self.pass_at if self.pass_at is not None else (1, self.samples))))

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if not self.greedy and self.samples == 0:
            raise ValueError("greedy is false and samples is 0: nothing to evaluate")
        bad = [k for k in self.pass_at or () if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"pass_at: {bad} not in [1, samples = {self.samples}] (pass@k needs at least "
                             "k samples per prompt)")
        return self
