"""``policy_lag_split``: the direct ratio split in three (spec section 7), engine ``pi_train@v / mu``, lag
``pi_old / pi_train@v`` and update ``pi_theta / pi_old``.

The trainer keeps a copy of the policy's weights per version still in use: one per optimizer step of lag, taken when
a generation batch starts and at the first micro-batch of every optimizer step, so that it holds every version an
engine can publish, also steps at which it did not generate (an asynchronous engine publishing after every optimizer
step, with ``num_iterations > 1`` or ``steps_per_generation`` > accumulation). After the mode has scored a batch
(pi_old exists then), it scores each stale version's rows with a scratch copy of the policy: one no-grad forward
(role ``version``: support-scored when matching, as pi_old and mu are; each row's own routes replayed with routing
replay) per stale version and generation batch.
The result rides in the batch as ``rollout_version_log_probs``; the mode's ratio decomposition reads it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from .. import support, trl_compat
from ..hooks import FORWARD_INPUT_KEYS, Feature, ForwardCall, GenerationBatch, LossStep, refuse_config

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer


class LagSplit(Feature):
    """The weights of every version in use, and the per-version log-probs (module docstring).

    Raises:
        NotImplementedError: at construction, on a backend that shards the parameters (DeepSpeed ZeRO-3, FSDP1,
            FSDP2): the version copies are whole-model copies (``state_dict`` of the unwrapped model, a deep copy
            for the scratch model), which those backends cannot make, and the version forward runs only on the
            ranks holding stale rows, which is a collective there (the message gives the memory it would need).
        ValueError: (``after_score``) a row's version is one whose weights this trainer never held (a version
            that is not a step at which it generated or trained, or one before the checkpoint it resumed from) or no
            longer holds (versions going backwards).
    """

    name = "lag_split"

    @classmethod
    def wanted(cls, args) -> bool:
        return bool(args.policy_lag_split)

    @classmethod
    def check_config(cls, args, correction) -> None:
        """``policy_lag_split``: not in bypass mode (no pi_old); ``rollout_rs_on="engine"`` needs it."""
        if args.policy_lag_split and correction.bypass_mode:
            refuse_config(
                "policy_lag_split needs pi_old (the lag ratio is pi_old / pi_train@v), which bypass mode does not "
                "compute; use decoupled mode or unset policy_lag_split."
            )
        if getattr(correction, "rollout_rs_on", "direct") == "engine" and not args.policy_lag_split:
            refuse_config(
                "rollout_rs_on='engine' computes every RS statistic on the engine factor pi_train@v / mu, which "
                "needs the weights of each row's policy version and one forward at them: set policy_lag_split=True, "
                "or rollout_rs_on='direct' (RS on pi_old / mu, staleness included)."
            )

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        refuse_sharded(trainer)
        self.weights: dict[int, dict[str, torch.Tensor]] = {}  # version (optimizer step) -> state dict
        self.model: Optional[torch.nn.Module] = None  # the scratch copy that scores old versions

    def _keep_current(self, trainer) -> None:
        """Training: keep a copy of the policy's weights as version ``global_step`` (the weights any engine syncing
        or publishing now would receive; pruned in ``after_score``), once per optimizer step."""
        step = trainer.state.global_step
        if trainer.metrics_mode == "train" and step not in self.weights:
            state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
            self.weights[step] = {k: v.detach().clone() for k, v in state.items()}

    @contextlib.contextmanager
    def generation(self, trainer, gen: GenerationBatch) -> Iterator[None]:
        """The weights of this generation's step (``_keep_current``); the version scorer published on the batch
        (``gen.version_log_probs``: the mode runs it early when RS judges the engine factor)."""
        self._keep_current(trainer)
        gen.version_log_probs = functools.partial(self.version_log_probs, trainer)
        yield

    def before_loss(self, trainer, step: LossStep) -> None:
        """The weights of every optimizer step, also one without a generation (``_keep_current``): an asynchronous
        engine publishes after every optimizer step (``VLLMCPURollout(async_depth=d)``), so a later batch can come
        from a step at which the trainer only trained on buffered rows (issue 44, item 2)."""
        self._keep_current(trainer)

    def after_score(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """``batch["rollout_version_log_probs"]`` (``version_log_probs``, unless the mode asked for it already: RS on
        the engine factor, ``rollout_rs_on="engine"``), then the weights no row needs any more are dropped."""
        if self.version_log_probs(trainer, batch) is None:
            return
        oldest = int(batch["rollout_policy_version"].min())
        for version in [v for v in self.weights if v < oldest]:
            del self.weights[version]

    def version_log_probs(self, trainer, batch: dict) -> Optional[torch.Tensor]:
        """(B, T) float32 log pi_train@v of each token at its own version v, stored as
        ``batch["rollout_version_log_probs"]`` (computed once per batch; the stored tensor afterwards). A token's
        version is its row's, or, for a row that spans a weight update, its own (``rollout_policy_version_tokens``):
        one forward per stale version over the rows holding a token of it. Tokens of the current version reuse
        pi_old exactly (their lag ratio is 1). None while the batch has no pi_old or no versions."""
        if "rollout_version_log_probs" in batch:
            return batch["rollout_version_log_probs"]
        old = batch.get("old_per_token_logps", batch.get("rollout_old_log_probs"))
        versions = batch.get("rollout_policy_version")
        if old is None or versions is None:
            return None
        step = trainer.state.global_step
        tokens = batch.get("rollout_policy_version_tokens")
        if tokens is None:
            tokens = versions[:, None].expand(old.shape)
        version_log_probs = old.detach().float().clone()
        for version in sorted(set(tokens.unique().tolist()) - {step}):
            weights = self.weights.get(version)
            if weights is None:
                raise ValueError(
                    f"policy_lag_split: rows of version {version} arrived, but the trainer holds no weights of that "
                    f"version (held: {sorted(self.weights)}); versions must be optimizer steps at which this trainer "
                    "generated or trained, never going backwards. A trainer resumed from a checkpoint holds no "
                    "weights of the steps before the resume (the checkpoint has the current ones only): restart "
                    "the engine with the trainer, or resume from a checkpoint at one of its weight syncs. Else "
                    "unset policy_lag_split."
                )
            at = tokens == version
            rows = at.any(dim=1)
            inputs = {k: batch[k][rows] for k in FORWARD_INPUT_KEYS if k in batch}  # the rows, their routes
            scored = self._log_probs_at_version(trainer, weights, inputs)
            version_log_probs[rows] = torch.where(at[rows], scored, version_log_probs[rows])
        batch["rollout_version_log_probs"] = version_log_probs
        return version_log_probs

    def _log_probs_at_version(self, trainer, weights: dict, rows: dict) -> torch.Tensor:
        """(b, T) float32 log-probs of ``rows`` under the policy with ``weights`` loaded (the scratch copy)."""
        if self.model is None:
            self.model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).eval()
        self.model.load_state_dict(weights)
        fwd = trl_compat.prompt_completion_inputs(rows)
        trainer.rollout_corr_forward_counts["version_log_probs"] += 1
        call = ForwardCall("version", self.model, batch=rows)
        with torch.no_grad():
            lp, _, _ = trainer.policy_forward(call, fwd, batch_size=trainer.args.per_device_train_batch_size)
        return support.invalidate_misses(lp.float(), call.miss)  # support matching: missed tokens NaN, as mu's


def refuse_sharded(trainer) -> None:
    """``policy_lag_split`` on a parameter-sharding backend: NotImplementedError naming the backend, the reasons and
    the memory its whole-model copies would take (see ``LagSplit``'s Raises)."""
    backend = trl_compat.sharded_backend(trainer.accelerator)
    if backend is None:
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    gib = trl_compat.full_parameter_bytes(model, trainer.accelerator.num_processes) / 2**30
    lag = trainer.args.max_policy_lag
    copies = (f"{lag + 2} copies = {(lag + 2) * gib:.3g} GiB per rank at max_policy_lag={lag}" if lag is not None
              else f"k + 1 copies = (k + 1) x {gib:.3g} GiB per rank at a lag of k steps")
    raise NotImplementedError(
        f"policy_lag_split is not supported on {backend}: it keeps a whole-model copy of the weights per version in "
        f"flight plus a scratch copy for the version forward ({gib:.3g} GiB each here: {copies}), which {backend} "
        "cannot take from its sharded parameters, and a rank runs the version forward only for the stale "
        "versions it holds, while on a sharded model every forward is a collective that all ranks must join (a "
        "hang when only some ranks hold stale rows). Use DDP or DeepSpeed ZeRO-1/2, or unset policy_lag_split "
        "(the rollout_corr/* diagnostics and the correction itself work on sharded backends)."
    )
