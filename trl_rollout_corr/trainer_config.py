"""``RolloutCorrGRPOConfig``: ``GRPOConfig`` plus the rollout-correction fields, and the checks run at construction.

Each part checks its own fields (``Feature.check_config``, ``CorrectionMode.check_config``); the checks run in one
fixed order (``RolloutCorrGRPOConfig.__post_init__``), so that a config with two faults reports the same first error
whatever part owns each check (``tests/unit/test_config_parts.py``): ``rollout_corr_old_forward``'s value, the
correction fields (``resolve``), TRL's own vLLM IS, ``GRPOConfig.__post_init__``; every feature's check in
``features.FEATURES`` order, present or not; the config's one mode (``modes.mode_class``: TRL's options against a
configured correction, then the mode's own); last the checks that span parts or concern the engines (TRL's vLLM
colocate fields, asynchronous generation, ``rs_keep_rejected_in_baseline``) and the CPU-autocast warning.
``trl_rollout_corr.trainer`` re-exports the class (its public import path).
"""

from __future__ import annotations

import argparse
import logging
import warnings
from dataclasses import dataclass, field
from typing import Optional

from trl import GRPOConfig

from . import features, modes
from .config import RolloutCorrectionArguments, RolloutCorrectionConfig
from .engines.transformers_generate import GENERATE_DTYPES
from .features.routing_replay import ROUTING_REPLAY_MODES
from .hooks import refuse_config as _refuse
from .old_forward import OLD_FORWARD_SETTINGS

logger = logging.getLogger(__name__)

__all__ = ["RolloutCorrGRPOConfig"]


class _OptionalBoolFlag(argparse.Action):
    """argparse action for an ``Optional[bool]`` field that also answers to TRL's ``--no_<name>`` spelling.

    ``--name`` (bare) is True, ``--name false`` is False, ``--no_name`` is False, an absent flag leaves None (unset).
    ``HfArgumentParser`` passes a field's ``metadata`` to ``add_argument`` (``aliases`` become extra option strings),
    which is how ``vllm_importance_sampling_correction`` keeps TRL's ``--no_vllm_importance_sampling_correction``
    flag while its default stays None (so that an explicit True can be told from "unset").
    """

    def __init__(self, option_strings, dest, nargs=None, const=None, **kwargs):
        super().__init__(option_strings, dest, nargs="?", const=True, **kwargs)
        self._negated = {s for s in option_strings if s.startswith(("--no_", "--no-"))}

    def __call__(self, parser, namespace, values, option_string=None):
        value = bool(values)
        setattr(namespace, self.dest, (not value) if option_string in self._negated else value)


def _no_flag(name: str) -> dict:
    return {"aliases": [f"--no_{name}", f"--no-{name.replace('_', '-')}"], "action": _OptionalBoolFlag}


@dataclass
class RolloutCorrGRPOConfig(RolloutCorrectionArguments, GRPOConfig):
    r"""``GRPOConfig`` plus rollout correction.

    The correction fields (``rollout_corr_preset`` and the fields of ``config.CORRECTION_FIELD_TABLE``) come from
    ``RolloutCorrectionArguments``, flat, so each works as a ``TrlParser``/``HfArgumentParser`` flag
    (``--rollout_is token``, a bare ``--bypass_mode``) and as a YAML key; explicitly set fields override the preset,
    and after construction the flat fields hold the effective values (``args.rollout_correction()`` is the validated
    config). (``RolloutCorrectionArguments`` comes first among the bases so that ``TrainingArguments``' fields keep
    their positions: ``RolloutCorrGRPOConfig("out")`` sets ``output_dir``, as ``GRPOConfig("out")`` does.)

    No correction configured (no IS, no RS, no bypass: the default and the ``disabled`` preset) means TRL's own
    GRPO, unchanged: every ``GRPOConfig`` option is accepted and behaves as in ``GRPOConfig``, and
    ``rollout_corr/*`` diagnostics are logged on the side where behaviour log-probs exist. With a correction
    configured, every TRL option the correction interacts with is checked here, at construction: it either works
    exactly (``docs/reference/trl-options.md``) or is refused with an error naming it.

    Parameters:
        rs_keep_rejected_in_baseline (`bool`, defaults to `False`):
            Keep the rows the correction empties in their group's reward mean/std (verl's behaviour). Default
            False: they leave the baseline (a row whose every group-mate is rejected then has advantage 0; with RS
            counted in ``rollout_corr/rs_lone_survivor_fraction``). Their own advantage is 0 either way. The rows it
            governs: decoupled mode, rows left without a loss token by RS, M2PO, ``max_policy_lag`` (stale at
            generation) or invalid tokens (NaN/inf log-probs, support misses); bypass mode, only the rows
            ``max_policy_lag`` drops at generation (RS runs in the loss there, after the advantages, so its rows
            always stay in). True where no row can leave the baseline (no correction, or bypass mode without
            ``max_policy_lag``) is refused.
        rollout_corr_compile (`bool`, defaults to `False`):
            Run the correction math through ``torch.compile`` (``correction.make_correction_fn(..., compile=True)``):
            same values, faster on large batches; the first step pays the compile. Used in both modes.
        rollout_dump_dir (`str`, *optional*):
            Write rollout records (``records/``, spec 10) into this folder: every trained sample of every logged
            step as Parquet, plus ``run.json`` (model, engine, sampling, tokenizer, correction) and ``logs.jsonl``
            (the logged values), for ``trl-rollout-corr analyze``. Unset (default): nothing is written. A folder
            that already holds a dump is refused.
        rollout_dump_every (`int`, defaults to `1`):
            Keep the rows of one logged window in N (every window's logged values are still written): bounds the
            size of a long run's dump. Needs ``rollout_dump_dir`` (a value other than 1 without it is refused).
        rollout_corr_compact_scoring (`bool`, defaults to `True`):
            Score only the trained (completion, non-padding) positions through the LM head in every log-prob
            forward (pi_old, pi_theta, pi_ref) on CPU, as TRL already does on Triton devices
            (``trl_compat.score_trained_tokens_only``): the same log-probs, entropies and gradients up to float
            rounding (over fewer rows the projection can round differently: 1e-7 relative), without the prompt and
            padding rows of the vocabulary projection. Only with a correction configured: without one the
            trainer keeps TRL's choice, so that it stays plain TRL bit for bit. False: TRL's choice (every position
            on CPU).
        rollout_corr_old_forward (`str`, defaults to `"auto"`):
            ``"auto"``: in training, pi_old is read from the first loss forward of each generation batch where that
            forward provably is pi_old (``old_forward``'s rule: ``steps_per_generation == 1``, no dropout, no
            ``policy_lag_split``, ...), which saves one forward per generation batch (decoupled mode, and the
            no-correction diagnostics); otherwise, and always with ``"always"``, pi_old has its own no-grad forward.
            One start-up log line says which, and why. Bypass mode has no pi_old forward (pi_old := mu): ``"always"``
            is refused there.
        rollout_support_matching (`str`, defaults to `"off"`):
            Sampling-support matching (``support``): ``"off"`` scores TRL's full-vocabulary log-probs (the start-up
            report names every sampler parameter that shapes mu but not them, and with truncation on one warning
            gives the measured mean log kept mass); ``"recompute"`` applies the engine's processors (penalties,
            temperature, top-k / top-p / min-p, in the engine's order) to the trainer's own logits in every policy
            forward (pi_old and pi_theta, gradients through the normaliser); ``"replay"`` uses the engine's
            kept-token sets (the ``transformers.generate`` path). Adds ``rollout_corr/support_*`` metrics.
        routing_replay (`str`, defaults to `"off"`):
            ``"r3"``: Rollout Routing Replay for mixture-of-experts models (``routing.py``): the rollout's expert
            choices (``transformers.generate``: recorded while sampling; a ``rollout_func``: its ``routed_experts``)
            travel with the batch as ``routed_experts`` and the policy forwards (pi_old, pi_theta; not pi_ref) route
            every token to them; ``rollout_corr/routing_mismatch_fraction`` (overall, ``/layer_<i>``) and
            ``rollout_corr/routing_token_mismatch_fraction`` count the trainer's own differing choices before
            substitution. ``"off"``: no capture, no replay.
        rollout_generate_dtype (`str`, *optional*):
            Plain ``transformers.generate`` path only: sample from a ``bfloat16`` / ``float16`` / ``float32`` copy of
            the weights (``engines.transformers_generate.generate_in_dtype``), e.g. a bf16 rollout engine next to a
            float32 trainer. Unset: generate with the weights as they are. Refused with ``use_vllm`` and with
            ``use_transformers_continuous_batching`` (paths that never run it).
        rollout_vllm_dtype (`str`, *optional*):
            TRL's vLLM colocate engine only (``use_vllm=True``, ``vllm_mode="colocate"``): ``"bfloat16"`` or
            ``"float32"``, passed to TRL's ``vllm.LLM(...)`` (``trl_compat.trl_vllm_colocate``; TRL 1.16 passes no
            dtype). Unset: TRL's, i.e. vLLM's ``"auto"``, which on CPU samples in bfloat16 even from a float32
            checkpoint; the dtype in use is recorded (``describe()``: run summary, records, model card).
        rollout_vllm_enforce_eager (`bool`, *optional*):
            TRL's vLLM colocate engine only: ``enforce_eager`` for TRL's ``vllm.LLM(...)`` (no torch.compile, no CUDA
            graphs). Unset: True on vLLM's CPU platform (SmolLM2-135M bf16: 4.5 s eager against 89 s compiling,
            measured), TRL's (compiled) elsewhere.
        max_policy_lag (`int`, *optional*):
            Drop every sample whose policy lag (optimizer steps between the version of the weights that generated
            it and the update that uses it; ``lag.py``) exceeds this, from the loss and (when the lag is already
            over the bound at generation) from its group's baseline, like a fully RS-rejected row; counted in
            ``rollout_corr/policy_lag_dropped_fraction`` (rows) and ``policy_lag_dropped_token_fraction``. Needs a
            configured correction and a generation path that reports versions (a ``rollout_func`` must return
            ``policy_version``). Unset: no filter.
        rollout_async_depth (`int`, defaults to `0`):
            Asynchronous GRPO (``async_generation``): an engine in its own process generates the next d generation
            batches (taken ahead from TRL's dataloader) while the trainer trains; the batch first trained at
            optimizer step s is generated with the weights of step ``max(0, s - d)`` exactly, and its rows carry that
            version (policy lag, ``max_policy_lag``). Logs ``rollout_async/{trainer_wait_s,engine_idle_s,
            generate_s,publish_s,version}``. 0: synchronous (TRL's path, unchanged). The engine: TRL's vLLM server
            (``use_vllm=True, vllm_mode="server"``; one request per row with its own seed) or, with
            ``use_vllm=False``, a transformers model in a child process. One process; refused (with the reason)
            with colocate vLLM, tools, a ``rollout_func``, PEFT, truncating samplers on the transformers engine,
            routing replay, server-mode evaluation, a resume inside a generation batch (resumed at R: max(R, s - d)).
        rollout_async_timeout_s (`float`, defaults to `600.0`):
            Seconds the asynchronous engine may take for one request before the run fails with its last log lines.
        rollout_async_server_log (`str`, *optional*):
            The vLLM server's log file (server mode), quoted in the error when the server fails.
        rollout_async_engine_threads (`int`, defaults to `1`):
            Torch threads of the asynchronous engine's process.
        policy_lag_split (`bool`, defaults to `False`):
            Split the direct ratio in three (spec section 7): engine ``pi_train@v / mu`` (numerics only), lag
            ``pi_old / pi_train@v`` (staleness only) and update ``pi_theta / pi_old``, logged as
            ``rollout_corr/{engine,lag,update,direct}_ratio_*``. Keeps a copy of the weights of every version still
            in use (one per optimizer step of lag) and runs one extra no-grad forward per stale version and
            generation batch. Decoupled mode or no correction (bypass has no pi_old).
        skip_empty_steps (`bool`, defaults to `False`):
            Skip ``optimizer.step()`` on an optimizer step in which no token carries gradient anywhere (every token
            rejected by RS, zero-weighted by IcePop or dropped by ``max_policy_lag``, over all micro-batches and
            ranks): the weights and the optimizer state stay as they are, where TRL would let AdamW's momentum and
            weight decay move the weights on a zero gradient. Logged as ``rollout_corr/skipped_step_fraction``; the
            learning-rate schedule and ``global_step`` advance as usual. Needs a configured correction; refused under
            DeepSpeed (its engine steps the optimizer itself).
        vllm_importance_sampling_correction (`bool`, *optional*):
            TRL's own vLLM IS correction (TRL's flags: ``--vllm_importance_sampling_correction [true|false]``,
            ``--no_vllm_importance_sampling_correction``). Unset: off when this config's correction is enabled (IS,
            RS or bypass), TRL's default (on) otherwise. Setting it True together with an enabled correction is an
            error (the two would both apply).

    Raises:
        ValueError / TypeError: at construction, for an invalid correction field, an unknown preset, a setting
            without its option (``rollout_rs_threshold`` without ``rollout_rs``), or a TRL option the configured
            correction cannot serve exactly (the message names the options involved).

    Warns:
        UserWarning: when ``bf16=True`` (TRL's default) on CPU, where autocast hides the mismatch.
    """

    rs_keep_rejected_in_baseline: bool = field(
        default=False,
        metadata={
            "help": "Keep the rows the correction empties (RS, M2PO, max_policy_lag, invalid tokens) in their GRPO "
            "group's mean/std (verl). Default: excluded. Bypass mode: only max_policy_lag's rows (refused without it)."
        },
    )
    rollout_corr_compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the correction math (same values, several times faster on large batches); the "
            "first step pays the compile (tens of seconds on CPU)."
        },
    )
    rollout_dump_dir: Optional[str] = field(
        default=None,
        metadata={
            "help": "Write rollout records (every trained sample per logged step, Parquet, plus run metadata) into "
            "this folder for `trl-rollout-corr analyze`. Unset: off."
        },
    )
    rollout_dump_every: int = field(
        default=1,
        metadata={"help": "With rollout_dump_dir: keep the rows of one logged window in N (bounds the dump size)."},
    )
    rollout_corr_compact_scoring: bool = field(
        default=True,
        metadata={
            "help": "Score only the trained positions through the LM head on CPU (as TRL does on Triton devices), "
            "with a correction configured: same log-probs and gradients up to float rounding, less work. False, and "
            "without a correction: TRL's choice (every position)."
        },
    )
    rollout_corr_old_forward: str = field(
        default="auto",
        metadata={
            "help": "'auto': read pi_old from the first loss forward where it provably is pi_old "
            "(steps_per_generation 1, no dropout, no policy_lag_split; the start-up log names the reason otherwise), "
            "one forward fewer per generation batch; 'always': pi_old's own forward."
        },
    )
    rollout_support_matching: str = field(
        default="off",
        metadata={
            "help": "Sampling-support matching: 'off' (TRL's full-vocabulary log-probs; the sampler parameters they "
            "ignore are reported), 'recompute' (the engine's top-k/top-p/min-p, penalties and temperature applied "
            "to the trainer's logits in every policy forward) or 'replay' (the engine's kept-token sets; "
            "transformers.generate path only)."
        },
    )
    routing_replay: str = field(
        default="off",
        metadata={
            "help": "MoE models: 'r3' replays the rollout's expert choices in the policy forwards (Rollout Routing "
            "Replay) and logs rollout_corr/routing_mismatch_fraction; 'off' (default): the trainer routes itself.",
            "choices": list(ROUTING_REPLAY_MODES),
        },
    )
    rollout_generate_dtype: Optional[str] = field(
        default=None,
        metadata={
            "help": "transformers.generate path: sample from a copy of the weights in this dtype "
            f"({', '.join(GENERATE_DTYPES)}), e.g. a bf16 rollout engine next to a float32 trainer. Unset: as loaded."
        },
    )
    rollout_vllm_dtype: Optional[str] = field(
        default=None,
        metadata={
            "help": "TRL's vLLM colocate engine (use_vllm, vllm_mode colocate): its dtype, bfloat16 or float32 (TRL "
            "passes none). Unset: TRL's (vLLM's 'auto', which on CPU is bfloat16 even for a float32 checkpoint)."
        },
    )
    rollout_vllm_enforce_eager: Optional[bool] = field(
        default=None,
        metadata={
            "help": "TRL's vLLM colocate engine: skip torch.compile / CUDA graphs (TRL passes no enforce_eager). "
            "Unset: eager on vLLM's CPU platform (compiling takes minutes there), TRL's (compiled) elsewhere.",
            **_no_flag("rollout_vllm_enforce_eager"),
        },
    )
    max_policy_lag: Optional[int] = field(
        default=None,
        metadata={
            "help": "Drop samples whose policy lag (optimizer steps since the weights that generated them) exceeds "
            "this from the loss and the group baseline; counted in rollout_corr/policy_lag_dropped_fraction. "
            "Unset: no filter."
        },
    )
    rollout_async_depth: int = field(
        default=0,
        metadata={
            "help": "Asynchronous GRPO: an engine in its own process generates the next d generation batches while "
            "the trainer trains; the batch first trained at optimizer step s is generated with the weights of step "
            "max(0, s - d) exactly. 0 (default): synchronous, TRL's own path. The engine: TRL's vLLM server "
            "(vllm_mode='server'), or with use_vllm=False a transformers model in a child process."
        },
    )
    rollout_async_timeout_s: float = field(
        default=600.0,
        metadata={"help": "Asynchronous GRPO: seconds the engine may take for one request (start-up, weight load, "
                  "generation batch) before the run fails naming its last log lines."},
    )
    rollout_async_server_log: Optional[str] = field(
        default=None,
        metadata={"help": "Asynchronous GRPO with TRL's vLLM server: the server's log file, quoted when it fails."},
    )
    rollout_async_engine_threads: int = field(
        default=1,
        metadata={"help": "Asynchronous GRPO: torch threads of the engine process."},
    )
    policy_lag_split: bool = field(
        default=False,
        metadata={
            "help": "Split the direct ratio into engine (pi_train@v / mu), lag (pi_old / pi_train@v) and update "
            "(pi_theta / pi_old): keeps the weights of every version in use and runs one extra forward per stale "
            "version. Decoupled mode or no correction."
        },
    )
    skip_empty_steps: bool = field(
        default=False,
        metadata={
            "help": "Skip optimizer.step() on a step where no token carries gradient on any rank (all rejected by "
            "RS / IcePop or dropped by max_policy_lag), so AdamW's momentum does not move the weights; logged as "
            "rollout_corr/skipped_step_fraction. Needs a correction; not with DeepSpeed."
        },
    )
    vllm_importance_sampling_correction: Optional[bool] = field(
        default=None,
        metadata={
            "help": "TRL's own vLLM IS correction. Unset: off when rollout correction is enabled, else TRL's default "
            "(on). True together with an enabled rollout correction is an error.",
            **_no_flag("vllm_importance_sampling_correction"),
        },
    )

    def __post_init__(self):
        if self.rollout_corr_old_forward not in OLD_FORWARD_SETTINGS:
            _refuse(f"rollout_corr_old_forward must be one of {OLD_FORWARD_SETTINGS}, got "
                    f"{self.rollout_corr_old_forward!r}.")
        correction = self.resolve()
        self._store_effective_fields(correction)
        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = not correction.enabled
            if correction.enabled and self.use_vllm:
                logger.warning(
                    "Rollout correction is enabled, so TRL's own vLLM importance-sampling correction "
                    "(vllm_importance_sampling_correction) is switched off: the mismatch is corrected once, by "
                    "trl_rollout_corr."
                )
        elif self.vllm_importance_sampling_correction and correction.enabled:
            raise ValueError(
                "vllm_importance_sampling_correction=True and rollout correction (rollout_is / rollout_rs / "
                "bypass_mode) are both enabled: the mismatch would be corrected twice. Unset "
                "vllm_importance_sampling_correction (it is then switched off) or disable the rollout correction."
            )
        GRPOConfig.__post_init__(self)
        features.check_config(self, correction)  # each feature's own fields, in FEATURES order
        modes.check_config(self, correction)  # then the config's one mode
        self._check_vllm_engine()
        self._check_async()
        self._check_keep_rejected(correction)
        self._warn_cpu_autocast()

    def _check_vllm_engine(self) -> None:
        """``rollout_vllm_dtype`` / ``rollout_vllm_enforce_eager``: TRL's colocate engine only; the dtype explicit."""
        set_fields = [name for name in ("rollout_vllm_dtype", "rollout_vllm_enforce_eager")
                      if getattr(self, name) is not None]
        if set_fields and not (self.use_vllm and self.vllm_mode == "colocate"):
            _refuse(f"{', '.join(set_fields)} configure TRL's vLLM colocate engine, but use_vllm={self.use_vllm}, "
                    f"vllm_mode={self.vllm_mode!r}: set use_vllm=True and vllm_mode='colocate' (a vLLM server is "
                    "configured where it starts), or unset them.")
        if self.rollout_vllm_dtype is not None and self.rollout_vllm_dtype not in ("bfloat16", "float32"):
            _refuse(f"rollout_vllm_dtype must be 'bfloat16' or 'float32' (or unset), got {self.rollout_vllm_dtype!r}.")

    def _check_async(self) -> None:
        """``rollout_async_depth``: an int >= 0; d >= 1 only on the transformers engine (``use_vllm=False``)."""
        depth = self.rollout_async_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            _refuse(f"rollout_async_depth must be an int >= 0 (optimizer steps the engine's weights trail the "
                    f"learner; 0: synchronous), got {depth!r}.")
        if isinstance(self.rollout_async_engine_threads, bool) or not isinstance(
                self.rollout_async_engine_threads, int) or self.rollout_async_engine_threads < 1:
            _refuse(f"rollout_async_engine_threads must be an int >= 1, got {self.rollout_async_engine_threads!r}.")
        if not (isinstance(self.rollout_async_timeout_s, (int, float)) and self.rollout_async_timeout_s > 0):
            _refuse(f"rollout_async_timeout_s must be > 0 seconds, got {self.rollout_async_timeout_s!r}.")
        if depth and self.use_vllm and self.vllm_mode != "server":
            _refuse(
                f"rollout_async_depth={depth} with vllm_mode={self.vllm_mode!r}: the asynchronous engine runs in its "
                "own process, TRL's vLLM server (vllm_mode='server') or, with use_vllm=False, a transformers model; "
                "colocate vLLM shares the trainer's process. Use one of those, or rollout_async_depth=0 "
                "(VLLMCPURollout(async_depth=d) emulates the staleness)."
            )
        if depth and self.rollout_generate_dtype is not None:
            _refuse(f"rollout_async_depth={depth}: its engine samples in float32; unset rollout_generate_dtype.")
        if depth and self.max_policy_lag is not None and self.max_policy_lag < depth:
            _refuse(
                f"max_policy_lag={self.max_policy_lag} < rollout_async_depth={depth}: every batch from step {depth} "
                f"on is generated {depth} optimizer steps behind, so every row would be dropped and nothing trained. "
                f"Set max_policy_lag >= {depth}, or a smaller rollout_async_depth."
            )

    def _check_keep_rejected(self, correction: RolloutCorrectionConfig) -> None:
        """``rs_keep_rejected_in_baseline=True`` only where a row can leave its group's baseline (its docstring)."""
        if not self.rs_keep_rejected_in_baseline:
            return
        if not correction.enabled:
            _refuse(
                "rs_keep_rejected_in_baseline=True keeps the rows the correction rejects in their group's baseline, "
                "but no correction is configured (TRL's GRPO runs unchanged and rejects nothing), so it would be "
                "ignored: configure one (e.g. rollout_rs with rollout_rs_threshold, or a rollout_corr_preset), or "
                "unset rs_keep_rejected_in_baseline."
            )
        if correction.bypass_mode and self.max_policy_lag is None:
            _refuse(
                "rs_keep_rejected_in_baseline=True has no effect in bypass mode without max_policy_lag: RS runs in "
                "the loss, after the advantages, so the rows it rejects always stay in their group's baseline; only "
                "rows that max_policy_lag drops at generation leave it. Unset rs_keep_rejected_in_baseline, set "
                "max_policy_lag, or use decoupled mode (bypass_mode=False), where RS-rejected rows leave the baseline."
            )

    def _warn_cpu_autocast(self) -> None:
        """bf16 autocast on CPU runs the generate forward and the training forwards in the same bf16 numerics."""
        if self.bf16 and self.device.type == "cpu":
            warnings.warn(
                "bf16=True (TRL's default) on CPU: accelerate runs every forward, generate's included, under bfloat16 "
                "autocast over the same float32 weights, so mu and pi_old share their numerics and rollout_corr/* "
                "shows almost no mismatch (kl ~1e-7) where a real bf16 rollout engine would differ. Set bf16=False to "
                "train in float32 (rollout_generate_dtype='bfloat16' samples from a bf16 copy of the weights).",
                UserWarning,
                stacklevel=4,  # the caller of RolloutCorrGRPOConfig(...) (through __init__ and __post_init__)
            )

