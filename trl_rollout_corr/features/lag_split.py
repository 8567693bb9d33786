"""``policy_lag_split``: the direct ratio split in three (spec section 7), engine ``pi_train@v / mu``, lag
``pi_old / pi_train@v`` and update ``pi_theta / pi_old``.

The trainer keeps the weights of every version still in use (``version_store``: a whole copy on one process, DDP and
ZeRO-1/2; this rank's own shards on DeepSpeed ZeRO-3 and FSDP2, one shard per version): one per optimizer step of
lag, taken when a generation batch starts and at the first micro-batch of every optimizer step, so that it holds every
version an engine can publish, also steps at which it did not generate (an asynchronous engine publishing after every
optimizer step, with ``num_iterations > 1`` or ``steps_per_generation`` > accumulation). After the mode has scored a
batch (pi_old exists then), it scores each stale version's rows: one no-grad forward (role ``version``:
support-scored when matching, as pi_old and mu are, over each row's own kept-token sets with support replay; each
row's own routes replayed with routing replay) per stale version and generation batch, with that version's weights (a
scratch copy, or the live sharded model with the version's shards swapped in).
The stale versions are the union over ranks (one all-reduce), so on a sharded model, where a forward is a collective,
every rank runs the same version forwards, each the same number of model forwards (TRL forwards
``per_device_train_batch_size`` rows at a time: a rank with fewer chunks of a version's rows than another, none
included, adds 1-row placeholder forwards whose results it discards); the versions no rank needs any more are dropped
on every rank alike.
The result rides in the batch as ``rollout_version_log_probs``; the mode's ratio decomposition reads it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from .. import support, trl_compat
from ..hooks import FORWARD_INPUT_KEYS, Feature, ForwardCall, GenerationBatch, LossStep, refuse_config
from ..version_store import store_for

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer


class LagSplit(Feature):
    """The weights of every version in use, and the per-version log-probs (module docstring).

    Attributes:
        weights: version (optimizer step) -> what ``store`` keeps of it (``version_store``); the same versions on
            every rank.
        store: ``version_store.FullCopies`` or ``RankShards`` (by backend).

    Raises:
        NotImplementedError: at construction, on FSDP1 or a ZeRO-3 setting whose shards it cannot keep
            (``version_store.store_for``).
        ValueError: (``after_score``, on every rank) a row's version, on any rank, is one whose weights this
            trainer never held (a version that is not a step at which it generated or trained) or no longer holds
            (versions going backwards). A resumed trainer holds the versions its checkpoint held (``state_dict``).
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
        self.store = store_for(trainer)
        self.weights: dict[int, object] = {}
        self._oldest: Optional[int] = None  # the oldest row version over all ranks of the training batch last scored
        self._restored: Optional[dict] = None  # load_state_dict's kept weights (CPU), placed at the next keep

    @property
    def model(self) -> Optional[torch.nn.Module]:
        """The scratch copy that scores old versions (``FullCopies``), or None (not built yet, or sharded)."""
        return getattr(self.store, "model", None)

    def kept_bytes(self) -> dict[int, int]:
        """Bytes this rank holds per kept version (a whole copy, or this rank's shards)."""
        return {version: self.store.kept_bytes(kept) for version, kept in self.weights.items()}

    def state_dict(self) -> dict:
        """The versions held at the checkpoint (``weights``: version -> this rank's kept copy or shards) and the
        oldest row version of the last training batch (``oldest``, the pruning bound): a resumed run scores the rows
        of versions before its checkpoint as the uninterrupted run does. The checkpoint grows by ``kept_bytes()``
        per rank."""
        weights = self.weights if self._restored is None else {**self._restored, **self.weights}
        return {"weights": dict(weights), "oldest": self._oldest}

    def load_state_dict(self, state) -> None:
        """Take back ``state_dict()``'s versions (placed like the live weights at the next ``_keep_current``)."""
        self._restored = {int(v): kept for v, kept in state["weights"].items()}
        self._oldest = None if state["oldest"] is None else int(state["oldest"])

    def _place_restored(self, trainer) -> None:
        """The restored versions, each copied into a ``store.keep`` of the live weights (their device, dtype and
        layout: this rank's shards on a sharded model).

        Raises:
            ValueError: a restored version whose tensors do not match the live weights' (another model or world).
        """
        restored, self._restored = self._restored, None
        for version, kept in sorted(restored.items()):
            like = self.store.keep(trainer)
            same = set(like) == set(kept) if isinstance(like, dict) else len(like) == len(kept)
            pairs = [(like[k], kept[k]) for k in like] if isinstance(like, dict) and same else list(zip(like, kept))
            if not same or any(a.shape != b.shape or a.dtype != b.dtype for a, b in pairs):
                raise ValueError(f"policy_lag_split: the checkpoint's weights of version {version} do not match this "
                                 "model's (another model or number of processes); resume with the checkpoint's.")
            for live, saved in pairs:
                live.copy_(saved)
            self.weights.setdefault(version, like)

    def _keep_current(self, trainer) -> None:
        """Training: keep the policy's weights as version ``global_step`` (the weights any engine syncing or
        publishing now would receive; pruned in ``after_score``), once per optimizer step; first the versions a
        resume restored (``load_state_dict``)."""
        if self._restored is not None:
            self._place_restored(trainer)
        step = trainer.state.global_step
        if trainer.metrics_mode == "train" and step not in self.weights:
            self.weights[step] = self.store.keep(trainer)

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
        the engine factor, ``rollout_rs_on="engine"``), then, in training only, the weights no row of any rank needs
        any more are dropped (on every rank alike). An evaluation batch prunes nothing: its rows may be newer than the
        next training batch's (an asynchronous engine's training rows lag, its evaluation rows need not), whose
        version must still be held."""
        if self.version_log_probs(trainer, batch) is None or trainer.metrics_mode != "train":
            return
        for version in [v for v in self.weights if self._oldest is not None and v < self._oldest]:
            del self.weights[version]

    def _stale_versions(self, trainer, local: dict, oldest: int, device=None) -> list[tuple[int, int]]:
        """The stale versions some rank holds rows of, each with the most forward chunks any rank needs for its rows
        of it (``local``: version -> this rank's chunks, ceil(rows / ``per_device_train_batch_size``)): sorted
        ``(version, max_chunks)``, the same list on every rank (one all-reduce), and, in training, ``self._oldest``,
        the oldest row version over all ranks (evaluation keeps it: it prunes nothing, ``after_score``).
        ``device``: where the all-reduce runs (the batch's device: NCCL reduces CUDA tensors only).

        Raises:
            ValueError: on every rank, when some rank's versions include one not held (class Raises).
        """
        held = sorted(self.weights)
        missing = sorted(set(local) - set(held))
        flags = torch.tensor([local.get(v, 0) for v in held] + [len(missing), -oldest], dtype=torch.long,
                             device=device)
        flags = trainer.rollout_corr_reducers.max(flags).cpu()
        if trainer.metrics_mode == "train":  # the same all-reduce on every rank in either mode
            self._oldest = -int(flags[-1])
        if int(flags[-2]) > 0:
            where = f"rows of version {missing[0]} arrived" if missing else "another rank got rows of a version"
            raise ValueError(
                f"policy_lag_split: {where}, but the trainer holds no weights of that "
                f"version (held: {held}); versions must be optimizer steps at which this trainer "
                "generated or trained, never going backwards (a trainer resumed from a checkpoint holds the "
                "versions the checkpoint held: an engine kept through the restart must not publish versions older "
                "than those). Restart the engine with the trainer, or unset policy_lag_split."
            )
        return [(v, chunks) for v, chunks in zip(held, flags[:-2].tolist()) if chunks > 0]

    def version_log_probs(self, trainer, batch: dict) -> Optional[torch.Tensor]:
        """(B, T) float32 log pi_train@v of each token at its own version v, stored as
        ``batch["rollout_version_log_probs"]`` (computed once per batch; the stored tensor afterwards). A token's
        version is its row's, or, for a row that spans a weight update, its own (``rollout_policy_version_tokens``):
        one forward per stale version of any rank over the rows holding a token of it (``_stale_versions``; on a
        sharded model a rank with fewer chunks of such rows than another adds placeholder forwards). Tokens of the
        current version reuse pi_old exactly (their lag ratio is 1). None while the batch has no pi_old or no
        versions."""
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
        batch_size = trainer.args.per_device_train_batch_size
        local = {}  # stale version -> this rank's forward chunks over the rows holding a token of it
        for version in set(tokens.unique().tolist()) - {step}:
            local[version] = -(-int((tokens == version).any(dim=1).sum()) // batch_size)
        placeholder = _forward_inputs(batch)  # row 0
        for version, chunks in self._stale_versions(trainer, local, int(versions.min()), old.device):
            at = tokens == version
            rows = at.any(dim=1)
            own = local.get(version, 0)
            joins = chunks - own if self.store.collective else 0  # a sharded model: as many forwards as any rank
            if own == 0 and joins == 0:
                continue
            inputs = _forward_inputs(batch, rows) if own else None
            scored = self._log_probs_at_version(trainer, version, inputs, joins, placeholder)
            if scored is not None:
                version_log_probs[rows] = torch.where(at[rows], scored, version_log_probs[rows])
        batch["rollout_version_log_probs"] = version_log_probs
        return version_log_probs

    def _log_probs_at_version(self, trainer, version: int, rows: Optional[dict], joins: int = 0,
                              placeholder: Optional[dict] = None) -> Optional[torch.Tensor]:
        """(b, T) float32 log-probs of ``rows`` under the policy at ``version`` (``store.loaded``; None when
        ``rows`` is None: this rank has none), chunked as TRL chunks (``per_device_train_batch_size`` rows per model
        forward); then, inside the same ``loaded`` (on a sharded model a collective too), ``joins`` model forwards of
        the 1-row ``placeholder`` whose results are discarded, so that every rank runs as many model forwards of
        this version as the rank with the most chunks (``_stale_versions``): a sharded forward is a collective."""
        trainer.rollout_corr_forward_counts["version_log_probs"] += 1
        batch_size = trainer.args.per_device_train_batch_size
        scored = None
        with self.store.loaded(trainer, self.weights[version]) as model, torch.no_grad():
            if rows is not None:
                call = ForwardCall("version", model, batch=rows)
                lp, _, _ = trainer.policy_forward(call, trl_compat.prompt_completion_inputs(rows),
                                                  batch_size=batch_size)
                scored = support.invalidate_misses(lp.float(), call.miss)  # matching: missed tokens NaN, as mu's
            for _ in range(joins):
                trainer.policy_forward(ForwardCall("version", model, batch=placeholder),
                                       trl_compat.prompt_completion_inputs(placeholder), batch_size=batch_size)
        return scored


def _forward_inputs(batch: dict, rows: Optional[torch.Tensor] = None) -> dict:
    """What a forward over some of ``batch``'s rows takes with them (``hooks.FORWARD_INPUT_KEYS``: the tokens, the
    routes to replay, replay's kept-token sets), for the rows ``rows`` ((B,) bool) or row 0 (None: the placeholder);
    a list (the kept-token sets, ``rollout_support``) is taken by the rows' indices."""
    out = {}
    for key in FORWARD_INPUT_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        if rows is None:
            out[key] = value[:1]
        elif isinstance(value, torch.Tensor):
            out[key] = value[rows]
        else:
            out[key] = [value[i] for i in rows.nonzero()[:, 0].tolist()]
    return out
