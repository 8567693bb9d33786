"""Asynchronous GRPO (issue 45, ``rollout_async_depth``): exact versions, bit-for-bit repeats, faults, shutdown.

Each training case runs a few steps of the tiny Llama with the engine (``TransformersProcessEngine``) in its own
process. Versions are checked three ways: against the rule worked out by hand below (batch j first trained at
optimizer step s_j is generated at version max(0, s_j - d)), against the engine's own log ("batch j: n rows at
version v", written by the child process when it serves the request) and against the lag the trainer logs.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import threading
import types

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from trl_rollout_corr import trl_compat
from trl_rollout_corr.async_generation import ASYNC_METRICS, AsyncGeneration
from trl_rollout_corr.engines.async_pipeline import AsyncRolloutPipeline, EngineError, request_seed
from trl_rollout_corr.metric_catalog import ASYNC_PREFIX, family_of

ASYNC = dict(max_steps=4, rollout_async_timeout_s=60.0)
TIMING = re.compile(r"^(rollout_async/(trainer_wait_s|engine_idle_s|generate_s|publish_s)|step_time|train_runtime|"
                    r"train_samples_per_second|train_steps_per_second)$")


def _engine_record(trainer) -> dict[int, int]:
    """batch -> version, from the engine process's own log."""
    text = open(trainer.rollout_async.log_path).read()
    return {int(b): int(v) for b, v in re.findall(r"batch (\d+): \d+ rows at version (\d+)", text)}


def _gen_versions(trainer) -> list:
    """Per logged step, the version of the batch generated in it (None: no generation in that step)."""
    return [h.get("rollout_async/version") for h in trainer.state.log_history if "loss" in h]


def _no_leftovers(trainer, pid) -> None:
    assert trainer.rollout_async.pipeline is None and trainer.rollout_async.engine.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not [t for t in threading.enumerate() if t.name == "rollout-async-worker"]


# ------------------------------------------------------------------------------------------------------ unit
@pytest.mark.unit
def test_request_seed():
    seeds = {request_seed(0, j, r) for j in range(20) for r in range(16)}
    assert len(seeds) == 320 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(3, 5, 7) == request_seed(3, 5, 7) != request_seed(4, 5, 7)
    expected = int(np.random.SeedSequence([3, 5, 7]).generate_state(1, dtype=np.uint64)[0]) >> 1
    assert request_seed(3, 5, 7) == expected
    with pytest.raises(ValueError, match=">= 0"):
        request_seed(0, -1, 0)


@pytest.mark.unit
def test_first_optimizer_step_by_hand():
    # generate_every = steps_per_generation * num_iterations micro-steps; GA micro-steps per optimizer step
    assert [trl_compat.first_optimizer_step(j, 1, 1) for j in range(4)] == [0, 1, 2, 3]
    assert [trl_compat.first_optimizer_step(j, 2, 1) for j in range(4)] == [0, 2, 4, 6]
    assert [trl_compat.first_optimizer_step(j, 2, 2) for j in range(4)] == [0, 1, 2, 3]
    assert [trl_compat.first_optimizer_step(j, 4, 2) for j in range(4)] == [0, 2, 4, 6]
    assert [trl_compat.first_optimizer_step(j, 2, 4) for j in range(4)] == [0, 0, 1, 1]
    # transformers 5.x ends an epoch of 3 micro-steps at accumulation 2 with a short step: 2 optimizer steps per
    # epoch, so epoch 2's first batch (micro-step 3) is trained at step 2, not 3 // 2 = 1
    assert [trl_compat.first_optimizer_step(j, 1, 2, steps_in_epoch=3) for j in range(7)] == [0, 0, 1, 2, 2, 3, 4]
    assert [trl_compat.first_optimizer_step(j, 2, 2, steps_in_epoch=4) for j in range(4)] == [0, 1, 2, 3]


@pytest.mark.unit
def test_end_of_run_by_hand():
    """The micro-steps transformers 5.x consumes up to optimizer step s (where a resume continues; at s = max_steps
    what a run trains) and the generation batches the look-ahead submits for a run (``end_of_run``)."""
    assert [trl_compat.micro_steps_at(s, 1) for s in (0, 1, 5)] == [0, 1, 5]
    assert [trl_compat.micro_steps_at(s, 2) for s in (0, 1, 5)] == [0, 2, 10]
    # epochs of 3 micro-steps at accumulation 2: steps of 2 + 1 items per epoch (the inverse of first_optimizer_step)
    assert [trl_compat.micro_steps_at(s, 2, steps_in_epoch=3) for s in range(6)] == [0, 2, 3, 5, 6, 8]
    assert [trl_compat.micro_steps_at(s, 1, steps_in_epoch=4) for s in (4, 5, 8)] == [4, 5, 8]
    with pytest.raises(ValueError, match="step >= 0"):
        trl_compat.micro_steps_at(-1, 1)
    assert trl_compat.micro_steps_trained(0, 4, 1) == 4
    assert trl_compat.micro_steps_trained(2, 5, 1, steps_in_epoch=8) == 5  # a resume keeps the run's end
    assert trl_compat.micro_steps_trained(5, 5, 1, steps_in_epoch=8) == 6  # resumed at the end: one more step
    assert trl_compat.micro_steps_trained(0, -1, 1) is None and trl_compat.micro_steps_trained(0, None, 1) is None
    # end_of_run = ceil(micro-steps trained / generate_every): a batch whose first micro-step is trained counts
    ag = types.SimpleNamespace(accumulation=1, generate_every=2, steps_in_epoch=16)
    end_of_run = AsyncGeneration.end_of_run
    assert [end_of_run(ag, 0, n) for n in (1, 4, 5)] == [1, 2, 3]  # max_steps 5: micro-steps 0-4, batches 0-2
    ag.accumulation, ag.generate_every = 2, 2  # one batch per optimizer step
    assert end_of_run(ag, 0, 4) == 4 and end_of_run(ag, 0, -1) is None


class _FakeEngine:
    timeout_s = 1.0

    def close(self):
        pass

    def log_tail(self):
        return ""


@pytest.mark.unit
def test_pipeline_stops_at_end_batch():
    """Versions only batches past ``end_batch`` would need are not published; such batches are refused."""
    unbounded = AsyncRolloutPipeline(_FakeEngine(), batch_version=lambda j: max(0, j - 2))
    bounded = AsyncRolloutPipeline(_FakeEngine(), batch_version=lambda j: max(0, j - 2), end_batch=4)
    try:
        assert [unbounded.needs(v) for v in range(5)] == [True] * 5
        assert [bounded.needs(v) for v in range(5)] == [True, True, False, False, False]  # batches 0-3: 0, 0, 0, 1
        for j in range(4):
            bounded.submit(j, [[1]], [j])
        with pytest.raises(ValueError, match="the run trains batches < 4"):
            bounded.submit(4, [[1]], [4])
    finally:
        unbounded.close()
        bounded.close()


@pytest.mark.unit
def test_trl_pins_for_async():
    """The TRL 1.16 lines ``async_generation`` relies on (``trl_compat``: generate_every, micro_step,
    generation_prompt_ids); a TRL change here must fail loudly."""
    from trl import GRPOTrainer

    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in prepare
    assert "if self._step % generate_every == 0 or self._buffered_inputs is None:" in prepare
    assert "self._step += 1" in inspect.getsource(GRPOTrainer.training_step)
    assert 'prompts = [x["prompt"] for x in inputs]' in inspect.getsource(GRPOTrainer._generate_and_score_completions)
    generate = inspect.getsource(GRPOTrainer._generate)
    assert "prompts = copy.deepcopy(prompts)" in generate
    assert "prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)" in generate
    assert "completion_ids, logprobs = self._generate_single_turn(" in generate
    sampler = inspect.getsource(GRPOTrainer._get_train_sampler)
    assert "repeat_count=self.num_iterations * self.args.steps_per_generation" in sampler
    # resume (AsyncGeneration.begin / resume_micro_step, trl_compat.loader_skips_itself): TRL's micro-step counter
    # starts at 0 in every trainer; transformers 5.x skips (global_step % steps per epoch) * accumulation items of
    # the resumed epoch through the module-level skip_first_batches, after on_train_begin's state is restored
    import transformers.trainer as hf_trainer
    from transformers import Trainer

    assert "self._step = 0" in inspect.getsource(GRPOTrainer.__init__)
    assert hf_trainer.skip_first_batches.__module__ == "accelerate.data_loader"
    run_epoch = inspect.getsource(Trainer._run_epoch)
    assert "train_dataloader = skip_first_batches(train_dataloader, steps_trained_in_current_epoch)" in run_epoch
    state = inspect.getsource(Trainer._init_training_state)
    assert "epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)" in state
    assert "steps_trained_in_current_epoch = self.state.global_step % num_update_steps_per_epoch" in state
    assert "steps_trained_in_current_epoch *= self.args.gradient_accumulation_steps" in state
    loop = inspect.getsource(Trainer._inner_training_loop)
    assert loop.index("self._init_training_state(") < loop.index("self.callback_handler.on_train_begin(") < \
        loop.index("self._run_epoch(")
    # the end (trl_compat.micro_steps_trained): state.max_steps is set before on_train_begin, also from epochs,
    # and training stops after the step that reaches it
    from transformers.trainer_callback import DefaultFlowCallback

    assert "self.state.init_training_references(self, max_steps, num_train_epochs, trial)" in state
    initial = inspect.getsource(Trainer.set_initial_training_values)
    assert "max_steps = math.ceil(args.num_train_epochs * num_update_steps_per_epoch)" in initial
    assert "if state.global_step >= state.max_steps:" in inspect.getsource(DefaultFlowCallback.on_step_end)


@pytest.mark.unit
def test_config_refusals(make_args, tmp_path):
    with pytest.raises(ValueError, match="rollout_async_depth must be an int >= 0"):
        make_args(tmp_path, rollout_async_depth=-1)
    with pytest.raises(ValueError, match="vllm_mode=.colocate."):
        make_args(tmp_path, rollout_async_depth=1, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match="rollout_async_timeout_s"):
        make_args(tmp_path, rollout_async_depth=1, rollout_async_timeout_s=0)
    # every batch from step d on is d steps stale: a smaller max_policy_lag would drop every row and train nothing
    with pytest.raises(ValueError, match="max_policy_lag=1 < rollout_async_depth=2: .* Set max_policy_lag >= 2"):
        make_args(tmp_path, rollout_async_depth=2, max_policy_lag=1, rollout_corr_preset="bypass_ppo_clip")
    assert make_args(tmp_path, rollout_async_depth=2, max_policy_lag=2,
                     rollout_corr_preset="bypass_ppo_clip").max_policy_lag == 2


# ------------------------------------------------------------------------------------------------- versions
# (overrides, expected version per logged step: None where the step trains rows generated earlier)
VERSION_CASES = {
    "d1": (dict(rollout_async_depth=1), [0, 0, 1, 2]),
    "d2": (dict(rollout_async_depth=2), [0, 0, 0, 1]),
    # generate_every = 2 micro-steps = 2 optimizer steps: batch j at step 2j, version max(0, 2j - 1)
    "d1_spg2": (dict(rollout_async_depth=1, steps_per_generation=2, per_device_train_batch_size=2, max_steps=5),
                [0, None, 1, None, 3]),
    "d1_iter2": (dict(rollout_async_depth=1, num_iterations=2, max_steps=5), [0, None, 1, None, 3]),
    # 2 prompts per batch: 4 batches (micro-steps, optimizer steps) per epoch; num_train_epochs=1.25 -> TRL's
    # max_steps = ceil(1.25 * 4) = 5: the run ends one batch into epoch 2
    "d2_epochs": (dict(rollout_async_depth=2, per_device_train_batch_size=8, max_steps=-1, num_train_epochs=1.25),
                  [0, 0, 0, 1, 2]),
}
# policy lag of the trained rows per step (current step - version), by hand from the table above
LAGS = {"d1": [0, 1, 1, 1], "d2": [0, 1, 2, 2], "d1_spg2": [0, 1, 1, 2, 1], "d1_iter2": [0, 1, 1, 2, 1],
        "d2_epochs": [0, 1, 2, 2, 2]}


@pytest.mark.parametrize("case", list(VERSION_CASES))
def test_versions_exact(case, llama_dir, tmp_path, make_trainer, step_logs, monkeypatch):
    overrides, expected = VERSION_CASES[case]
    published = []
    publish = AsyncRolloutPipeline.publish
    monkeypatch.setattr(AsyncRolloutPipeline, "publish",
                        lambda self, version, state: (published.append(version), publish(self, version, state)))
    trainer = make_trainer(llama_dir, tmp_path, **{**ASYNC, **overrides})
    trainer.train()
    assert _gen_versions(trainer) == expected
    assert [h["rollout_corr/policy_lag_mean"] for h in step_logs(trainer)] == LAGS[case]
    generated = [v for v in expected if v is not None]
    record = _engine_record(trainer)
    assert [record[j] for j in range(len(generated))] == generated  # the engine's own record
    # at the first step the engine holds version 0 = the trainer's weights: its mu equals the trainer's log-probs
    # to float32 precision (the engine samples softmax(logits / T), the distribution TRL scores)
    assert step_logs(trainer)[0]["rollout_corr/log_ppl_abs_diff"] < 1e-5
    # the engine generated exactly the batches the run trained (none of the d batches the look-ahead would take
    # past max_steps), and the trainer published exactly the versions they need
    assert sorted(record) == list(range(len(generated)))
    assert published == sorted(set(generated))
    # the rollout_async/* keys the run logged are the ones async_generation declares (ASYNC_METRICS, which
    # tests/unit/test_metric_catalog.py checks against the catalogue), each in exactly one catalogue family
    logged = {k for h in trainer.state.log_history for k in h if k.startswith(ASYNC_PREFIX)}
    assert sorted(logged) == sorted(ASYNC_METRICS)
    assert all(len(family_of(k)) == 1 for k in logged)


def test_repeat_bit_for_bit(llama_dir, tmp_path, make_trainer):
    runs = []
    for i in range(2):
        trainer = make_trainer(llama_dir, tmp_path / str(i), rollout_async_depth=1, max_steps=3,
                               rollout_corr_preset="decoupled_k3_rs_token_tis")
        trainer.train()
        logs = [{k: v for k, v in h.items() if not TIMING.match(k)} for h in trainer.state.log_history]
        runs.append((logs, {k: v.clone() for k, v in trainer.model.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    initial = make_trainer(llama_dir, tmp_path / "x").model.state_dict()
    assert any(not torch.equal(runs[0][1][k], initial[k]) for k in initial)  # it trained


def test_lag_split_and_rs_on_engine(llama_dir, tmp_path, make_trainer, step_logs):
    """policy_lag_split on real asynchronous rows: the engine factor pi_train@v / mu is 1 to float precision (the
    engine is exact at the right version), all the staleness is in the lag factor; RS on the engine factor keeps
    every row."""
    trainer = make_trainer(llama_dir, tmp_path, rollout_async_depth=1, max_steps=4,
                           rollout_corr_preset="decoupled_k3_rs_token_tis", policy_lag_split=True,
                           rollout_rs_on="engine")
    trainer.train()
    logs = step_logs(trainer)
    stale = [h for h in logs if h["rollout_corr/policy_lag_mean"] == 1]
    assert len(stale) == 3
    for h in stale:
        assert h["rollout_corr/engine_ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert h["rollout_corr/engine_ratio_p01"] == pytest.approx(1.0, abs=1e-4)
        assert h["rollout_corr/rollout_rs_engine_masked_fraction"] == 0.0
    assert max(abs(h["rollout_corr/lag_ratio_max"] - 1) for h in stale) > 1e-2  # the staleness is real


# ---------------------------------------------------------------------------------------------------- faults
class _AtStep(TrainerCallback):
    def __init__(self, step, action):
        self.step, self.action = step, action

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action()


def _trainer_with(make_trainer, llama_dir, tmp_path, action_factory, **overrides):
    trainer = make_trainer(llama_dir, tmp_path, **{**ASYNC, "rollout_async_depth": 1, "max_steps": 6, **overrides})
    pids = []

    def act():
        pids.append(trainer.rollout_async.engine_pid)
        action_factory(trainer)()

    trainer.add_callback(_AtStep(2, act))
    return trainer, pids


def test_engine_dies(llama_dir, tmp_path, make_trainer):
    trainer, pids = _trainer_with(make_trainer, llama_dir, tmp_path,
                                  lambda t: lambda: os.kill(t.rollout_async.engine_pid, signal.SIGKILL))
    with pytest.raises(EngineError, match=r"died \(exit code -9\)[\s\S]*engine log[\s\S]*at version"):
        trainer.train()
    _no_leftovers(trainer, pids[0])


def test_engine_hangs(llama_dir, tmp_path, make_trainer):
    import time

    trainer, pids = _trainer_with(make_trainer, llama_dir, tmp_path,
                                  lambda t: lambda: os.kill(t.rollout_async.engine_pid, signal.SIGSTOP),
                                  rollout_async_timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"did not answer its (generation batch|load of version) \d+ within 2 s"):
        trainer.train()
    assert time.monotonic() - started < 30
    _no_leftovers(trainer, pids[0])


def test_failed_publish_fails_the_run(llama_dir, tmp_path, make_trainer, monkeypatch):
    from trl_rollout_corr.engines.async_pipeline import AsyncRolloutPipeline

    publish = AsyncRolloutPipeline.publish

    def broken(self, version, state):
        if version >= 1:
            state.pop(next(iter(state)))  # a weight missing: the engine must not generate on unknown weights
        publish(self, version, state)

    monkeypatch.setattr(AsyncRolloutPipeline, "publish", broken)
    trainer = make_trainer(llama_dir, tmp_path, **ASYNC, rollout_async_depth=1)
    with pytest.raises(EngineError, match=r"failed its load of version 1[\s\S]*Missing key"):
        trainer.train()
    assert [h.get("rollout_async/version") for h in trainer.state.log_history if "loss" in h] == [0, 0]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_stop_on_exception_leaves_nothing(error, llama_dir, tmp_path, make_trainer):
    def raise_it():
        raise error("stop")

    trainer, pids = _trainer_with(make_trainer, llama_dir, tmp_path, lambda t: raise_it)
    with pytest.raises(error):
        trainer.train()
    _no_leftovers(trainer, pids[0])


def test_end_leaves_nothing(llama_dir, tmp_path, make_trainer):
    trainer = make_trainer(llama_dir, tmp_path, **{**ASYNC, "max_steps": 2}, rollout_async_depth=1)
    pids = []
    trainer.add_callback(_AtStep(1, lambda: pids.append(trainer.rollout_async.engine_pid)))
    trainer.train()
    _no_leftovers(trainer, pids[0])


def test_resume_restarts_the_pipeline_at_the_checkpoint(llama_dir, tmp_path, make_trainer, step_logs):
    """d = 2, 5 steps, a checkpoint at step 2. Uninterrupted, the batch first trained at optimizer step s is generated
    at version max(0, s - 2): [0, 0, 0, 1, 2]. Resumed from step 2 (R), only the checkpoint's weights exist, so the
    batches of steps 2, 3, 4 are generated at max(R, s - 2) = [2, 2, 2] (lags 0, 1, 2: fewer steps back than d right
    after the restart, d from step R + d on). Batches keep their index from the run's start (the same prompts and
    seeds); the versions are the engine's own record, and at step R its mu equals the trainer's log-probs (it holds
    the checkpoint's weights)."""
    run = dict(ASYNC, rollout_async_depth=2, max_steps=5, save_strategy="steps", save_steps=2)
    first = make_trainer(llama_dir, tmp_path / "a", **run)
    first.train()
    assert _gen_versions(first) == [0, 0, 0, 1, 2]
    resumed = make_trainer(llama_dir, tmp_path / "b", **run)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    assert _gen_versions(resumed) == [0, 0, 2, 2, 2]  # steps 0-1 from the checkpoint's log history
    logs = step_logs(resumed)
    assert [h["step"] for h in logs] == [1, 2, 3, 4, 5]
    assert [h["rollout_corr/policy_lag_mean"] for h in logs] == [0, 1, 0, 1, 2]
    assert _engine_record(first) == {0: 0, 1: 0, 2: 0, 3: 1, 4: 2}  # nothing generated past max_steps
    assert _engine_record(resumed) == {2: 2, 3: 2, 4: 2}  # batches 5, 6 never requested
    assert logs[2]["rollout_corr/log_ppl_abs_diff"] < 1e-5  # version 2 = the checkpoint's weights
    assert logs[3]["rollout_corr/log_ppl_abs_diff"] > 1e-4  # one step stale
    assert resumed.rollout_async.pipeline is None and resumed.state.global_step == 5


def test_resume_inside_a_generation_batch_is_refused(llama_dir, tmp_path, make_trainer):
    trainer = make_trainer(llama_dir, tmp_path, rollout_async_depth=1, steps_per_generation=2,
                           per_device_train_batch_size=2)
    ag = trainer.rollout_async
    ag.steps_in_epoch = 8  # micro-steps per epoch, as start() reads from TRL's loader
    assert [ag.resume_micro_step(s) for s in (0, 2, 4, 8)] == [0, 2, 4, 8]
    with pytest.raises(ValueError, match=r"optimizer step 3 \(micro-step 3\) lies inside a generation batch of 2"):
        ag.resume_micro_step(3)
    trainer.args.ignore_data_skip = True
    with pytest.raises(ValueError, match="set ignore_data_skip=False"):
        ag.resume_micro_step(2)


def test_unsupported_sampler_refused(llama_dir, tmp_path, make_trainer):
    with pytest.raises(ValueError, match=r"rollout_async_depth=1: .*top_k=5"):
        make_trainer(llama_dir, tmp_path, rollout_async_depth=1, top_k=5)


@pytest.mark.unit
def test_several_ranks_refused_with_the_reason():
    """2 ranks (issue 45, Show): not supported under TRL 1.16; refused at construction, saying why."""
    import types

    from trl_rollout_corr.async_generation import check_async_trainer

    fake = types.SimpleNamespace(args=types.SimpleNamespace(rollout_async_depth=1),
                                 accelerator=types.SimpleNamespace(num_processes=2))
    with pytest.raises(ValueError, match=r"rollout_async_depth=1: it runs on one process, not 2 \(.*rank-distinct "
                                         r"seeds.*VLLMClient on the main process only.*Set rollout_async_depth=0"):
        check_async_trainer(fake)


@pytest.mark.parametrize("kwargs, named", [
    ({"min_new_tokens": 3}, "min_new_tokens=3"),
    ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size=2"),
    ({"suppress_tokens": [5]}, r"suppress_tokens=\[5\]"),
    ({"bad_words_ids": [[5]]}, r"bad_words_ids=\[\[5\]\]"),
    ({"temperature": 0.5}, r"temperature=0.5 \(the engine samples at args.temperature=1.0\)"),
    ({"max_new_tokens": 3}, r"max_new_tokens=3 \(the engine stops at max_completion_length=8\)"),
])
def test_generation_kwargs_the_engine_would_ignore_are_refused(kwargs, named, llama_dir, tmp_path, make_trainer):
    """The transformers engine samples softmax(logits / T) up to max_completion_length tokens: a logits processor or
    stopping rule from generation_kwargs would be ignored (the sampler not the one configured), so it is refused,
    naming the setting and the fix."""
    with pytest.raises(ValueError, match=rf"rollout_async_depth=1: .*{named}.*remove them \(generation_kwargs"):
        make_trainer(llama_dir, tmp_path, rollout_async_depth=1, generation_kwargs=kwargs)
    make_trainer(llama_dir, tmp_path / "ok", rollout_async_depth=1, generation_kwargs={"do_sample": True})


@pytest.mark.unit
def test_server_requests_run_on_daemon_threads_so_a_hung_request_cannot_block_exit(tmp_path):
    """A request stuck on a hung server (TRL's client has no timeout) must not keep the interpreter alive at exit,
    which a ThreadPoolExecutor's worker would (Python joins those at exit even after shutdown(wait=False))."""
    import subprocess
    import sys
    import time

    from trl_rollout_corr.engines.daemon_requests import DaemonRequests

    pool = DaemonRequests(2)
    assert [pool.submit(pow, 2, k).result(timeout=10) for k in range(3)] == [1, 2, 4]
    failed = pool.submit(int, "x")
    with pytest.raises(ValueError):
        failed.result(timeout=10)
    code = ("import time; from trl_rollout_corr.engines.daemon_requests import DaemonRequests; "
            "p = DaemonRequests(1); p.submit(time.sleep, 3600); time.sleep(0.2); p.shutdown(); print('exiting')")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "exiting", out.stderr
    assert time.monotonic() - t0 < 30


def test_close_never_writes_into_a_request_still_being_written(tmp_path):
    """A stopped engine that no longer reads blocks the worker thread in the middle of writing a request (a weight
    load is hundreds of MB). ``close`` must not write its "close" into that socket too (it blocked the trainer's
    thread forever in the full suite: test_engine_hangs under load); it kills the child at once instead."""
    import socket
    import subprocess
    import sys
    import threading
    import time
    from multiprocessing.connection import Connection

    from trl_rollout_corr.engines.async_pipeline import EngineError, TransformersProcessEngine

    engine = TransformersProcessEngine(str(tmp_path), temperature=1.0, max_tokens=4, eos_token_ids=[0],
                                       log_path=str(tmp_path / "engine.log"))
    ours, theirs = socket.socketpair()  # the child holds `theirs` and never reads it: a stopped engine
    engine._conn = Connection(ours.detach())
    engine.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                      pass_fds=(theirs.fileno(),))
    theirs.close()
    failed = []

    def write():
        try:
            engine._call(("load", 1, {"w": b"x" * (64 << 20)}), "load of version 1")
        except EngineError as err:
            failed.append(err)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    deadline = time.monotonic() + 10
    while not engine._sending.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the 64 MB write is now blocked in the full socket
    process, started = engine.process, time.monotonic()
    engine.close()
    assert time.monotonic() - started < 5  # killed at once, not after terminate's grace
    assert process.returncode == -signal.SIGKILL
    writer.join(10)
    assert not writer.is_alive() and len(failed) == 1  # its write failed once the socket closed


def test_a_write_cut_by_close_is_an_engine_error(tmp_path, monkeypatch):
    """``close`` closes the socket; a write still looping in ``Connection._send`` then calls ``write(None, ...)``:
    a TypeError (seen under load: the writer's partial write returned after the child was killed). The caller gets
    the EngineError of a stopping pipeline, not a TypeError; while the engine is open a TypeError stays one."""
    from trl_rollout_corr.engines import async_pipeline
    from trl_rollout_corr.engines.async_pipeline import EngineError, TransformersProcessEngine

    engine = TransformersProcessEngine(str(tmp_path), temperature=1.0, max_tokens=4, eos_token_ids=[0],
                                       log_path=str(tmp_path / "engine.log"))

    def cut(conn, obj):
        raise TypeError("'NoneType' object cannot be interpreted as an integer")

    monkeypatch.setattr(async_pipeline, "_send", cut)
    engine.process = object()  # open: the TypeError is a bug, re-raised as is
    with pytest.raises(TypeError):
        engine._call(("load", 1, {}), "load of version 1")
    engine.process = None  # closed (close() sets it first)
    with pytest.raises(EngineError, match=r"was closed \(the pipeline is stopping\) during its load of version 1"):
        engine._call(("load", 1, {}), "load of version 1")
